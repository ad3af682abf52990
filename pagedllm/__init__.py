from pagedllm.version import __version__

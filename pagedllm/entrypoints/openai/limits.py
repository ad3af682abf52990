"""Default limits of `pagedllm serve` (a light module: the CLI reads them to build its --help)."""

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# Sequences (prompts x n) admitted but not yet started. 256 keeps a small machine responsive: the
# queue drains in seconds to minutes there, and clients beyond it get a 503 they can retry at once.
DEFAULT_MAX_WAITING_REQUESTS = 256
# A token is rarely longer than 32 characters: text beyond max_model_len x 32 cannot fit the context.
PROMPT_CHARS_PER_TOKEN = 32
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_WRITE_TIMEOUT_S = 60.0
DEFAULT_TOKENIZE_TIMEOUT_S = 30.0
TOKENIZER_WORKERS = 2

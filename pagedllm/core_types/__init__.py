"""Wire types: what the engine core, the executor and the workers hand each other.

Leaf modules: they import nothing of engine/, worker/, executor/ or spec_decode/, so every side of a
boundary can depend on them without depending on the other side (as vLLM V1 keeps SchedulerOutput
apart from the scheduler and ModelRunnerOutput apart from the runner).
"""

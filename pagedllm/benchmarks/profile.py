"""`pagedllm bench throughput --profile`: where an engine step's time goes.

Wraps the engine's own methods for the duration of a run and charges each call's exclusive time (its own
time minus that of wrapped calls inside it) to one phase: scheduling, input preparation, forward (the
model and its LM head), sampling, detokenisation, output processing, and "other" (the rest of
LLMEngine.step). Engine overhead is every phase but forward; it is also given over the decode steps
alone (no prompt token computed), where the forward is shortest and the overhead goal is hardest,
apart from the steps that prefill.

The worker's side of a step is not wrapped: the model runner times its own phases in every step
(ModelRunnerOutput.prepare_s, forward_s, sample_s: a few clock reads), and where it runs in this process
the executor's call is split by them (the plan's encoding is input preparation too; the rest of the
call, such as a speculative proposer's drafting, is "other"). A wrapper costs a few microseconds of
cold code per call: around each of the worker's phases, that read as a tenth of a decode step's
overhead that the engine does not spend.

Where the model runs in a worker process (distributed_executor_backend='mp', and async scheduling, which
overlaps the engine's work with the worker's forward pass), the engine process only sees itself wait, so
the overhead is measured on the step's critical path instead: the step's wall time less the worker's own
forward pass and LM head (each step's output reports them). What is left is every moment the worker was
not running the model: its input preparation and sampling, the messages, and whatever engine work was not
hidden behind the forward pass. Wall-clock timers, no tracing of every
Python call, so the profile barely slows the run; on CUDA the forward is asynchronous and its time lands
on whichever phase first waits for the device, so read the split there with care.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

PHASES = ("scheduling", "input preparation", "forward", "sampling", "detokenisation", "output processing", "other")
_MISSING = object()


class StepProfiler:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        # the same over the decode steps only (every scheduled request past its prompt)
        self.decode_seconds: dict[str, float] = defaultdict(float)
        self.decode_steps = 0
        self._step_seconds: dict[str, float] = defaultdict(float)  # the current step's phases
        self._plan: Any = None  # the current step's SchedulerOutput
        self._children: list[float] = []  # per active wrapped call: time spent in wrapped calls inside it
        self._patches: list[tuple[Any, str, Any]] = []
        # Set where the model runs in worker processes: "forward" is then the engine waiting on the workers
        # (their input preparation, forward and sampling, and the messages), and the overhead is the
        # engine process's own.
        self.workers_in_forward = False
        # the workers' model forward + LM head (ModelRunnerOutput.forward_s), over all and decode steps
        self.worker_forward_s = 0.0
        self.decode_worker_forward_s = 0.0
        self._step_worker_forward_s = 0.0
        self._finished_plan: Any = None  # the plan whose results the current step applied

    def wrap(self, owner: Any, name: str, phase: str,
             split: Callable[[Any], Iterable[tuple[str, float]]] | None = None) -> None:
        """Time owner.name (an instance's method, or a class's function) as `phase`; absent names are
        skipped, so the profile follows the engine's layout where it has the method. `split`: the parts of
        a call's time its result reports (phase, seconds), charged to their phases instead."""
        fn = getattr(owner, name, None)
        if fn is None:
            return
        # (locals, not attribute reads: the wrapper's own cost lands in its caller's phase)
        children, seconds, step_seconds, clock = self._children, self.seconds, self._step_seconds, time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            children.append(0.0)
            start = clock()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                elapsed = clock() - start
                exclusive = elapsed - children.pop()
                if split is not None and result is not None:
                    for part, part_seconds in split(result):
                        seconds[part] += part_seconds
                        step_seconds[part] += part_seconds
                        exclusive -= part_seconds
                seconds[phase] += exclusive
                step_seconds[phase] += exclusive
                if children:
                    children[-1] += elapsed

        self._replace(owner, name, timed)

    def _replace(self, owner: Any, name: str, fn: Any) -> None:
        """Set owner.name to fn until detach()."""
        self._patches.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, fn)

    def attach(self, engine: Any) -> StepProfiler:
        self.wrap(engine, "step", "other")  # its patch restores the engine's own step at detach
        timed_step = engine.step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self.steps += 1
            self._step_seconds.clear()
            self._plan = self._finished_plan = None
            self._step_worker_forward_s = 0.0
            try:
                return timed_step(*args, **kwargs)
            finally:  # outside the timed step: what this costs is no phase's
                # with async scheduling the step applies the results of a plan made in the step before
                plan = self._finished_plan if self._finished_plan is not None else self._plan
                self.worker_forward_s += self._step_worker_forward_s
                if plan is not None and plan.requests and all(
                        start >= request.num_prompt_tokens for request, start in zip(plan.requests, plan.start_pos)):
                    self.decode_steps += 1
                    self.decode_worker_forward_s += self._step_worker_forward_s
                    for phase, seconds in self._step_seconds.items():
                        self.decode_seconds[phase] += seconds

        engine.step = counted_step
        scheduler = engine.scheduler
        for name in ("schedule", "update", "finish_requests"):
            self.wrap(scheduler, name, "scheduling")
        timed_schedule = scheduler.schedule

        def noted_schedule(*args: Any, **kwargs: Any) -> Any:
            plan = timed_schedule(*args, **kwargs)
            if self._plan is None:  # the step's plan, not the empty one a step that goes idle makes last
                self._plan = plan
            return plan

        scheduler.schedule = noted_schedule  # restored with the timed layer (same attribute)
        # None where the runners live in worker processes (distributed_executor_backend='mp'): the engine's
        # wait on them is then charged to "forward" (see workers_in_forward)
        runner = getattr(engine, "model_runner", None)
        if runner is not None:
            self.wrap(getattr(engine.model_executor, "encoder", None), "encode", "input preparation")
            # one step in this process: the runner's own clocks split it (the rest, such as drafting, is "other")
            self.wrap(engine.model_executor, "execute_model", "other", split=lambda output: (
                ("input preparation", output.prepare_s), ("forward", output.forward_s),
                ("sampling", output.sample_s)))
        else:
            executor = getattr(engine, "model_executor", None)
            if executor is not None:
                self.wrap(executor, "execute_model", "forward")
                self.wrap(executor, "get_model_output", "forward")  # async scheduling's wait
                self.workers_in_forward = True
        core = getattr(engine, "engine_core", None)
        if core is not None:
            finish_step = core._finish_step

            def noted_finish_step(scheduler_output: Any, model_output: Any) -> Any:
                if self._finished_plan is None:
                    self._finished_plan = scheduler_output
                self._step_worker_forward_s += model_output.forward_s
                return finish_step(scheduler_output, model_output)

            self._replace(core, "_finish_step", noted_finish_step)
        self.wrap(engine.output_processor, "process_outputs", "output processing")
        # per sample, not per token: a wrapper costs about a microsecond a call, which around each of a
        # final step's 64 x 32 tokens read as a whole point of detokenisation that the run never spends
        self.wrap(engine.output_processor, "_detokenize", "detokenisation")
        return self

    def detach(self) -> None:
        for owner, name, original in reversed(self._patches):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._patches.clear()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def overhead_fraction(self) -> float:
        """Engine overhead's share of step time: all but the forward pass (with workers in other
        processes, all but their own forward pass: see the module docstring)."""
        total = self.total_s
        return (total - self.forward_s) / total if total else 0.0

    @property
    def forward_s(self) -> float:
        """The forward pass's seconds: the workers' own where they run in other processes."""
        return self.worker_forward_s if self.workers_in_forward else self.seconds["forward"]

    @property
    def decode_forward_s(self) -> float:
        """The same over the decode steps."""
        return self.decode_worker_forward_s if self.workers_in_forward else self.decode_seconds["forward"]

    @property
    def engine_process_fraction(self) -> float:
        """With workers in other processes: the engine process's own phases' share of step time (less
        than the overhead on the critical path; with async scheduling mostly hidden behind the forward)."""
        total = self.total_s
        return (total - self.seconds["forward"]) / total if total else 0.0

    @property
    def decode_total_s(self) -> float:
        return sum(self.decode_seconds.values())

    @property
    def decode_overhead_fraction(self) -> float:
        total = self.decode_total_s
        return (total - self.decode_forward_s) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "seconds": {p: self.seconds[p] for p in PHASES},
                "total_s": self.total_s, "overhead_fraction": self.overhead_fraction,
                "decode_steps": self.decode_steps,
                "decode_seconds": {p: self.decode_seconds[p] for p in PHASES},
                "decode_overhead_fraction": self.decode_overhead_fraction,
                "workers_in_forward": self.workers_in_forward,
                "worker_forward_s": self.worker_forward_s, "decode_worker_forward_s": self.decode_worker_forward_s,
                "engine_process_fraction": self.engine_process_fraction}

    def format(self) -> str:
        total = self.total_s or float("nan")
        # the last column: the same phase over the decode steps alone, where the overhead goal is measured
        lines = [f"{'phase':<20} {'seconds':>9} {'of step':>8} {'ms/step':>8} {'decode ms/step':>15}"]
        for phase in PHASES:
            s = self.seconds[phase]
            name = "waiting on workers" if phase == "forward" and self.workers_in_forward else phase
            decode_ms = 1e3 * self.decode_seconds[phase] / self.decode_steps if self.decode_steps else float("nan")
            lines.append(f"{name:<20} {s:>9.3f} {s / total:>8.1%} {1e3 * s / max(self.steps, 1):>8.2f} "
                         f"{decode_ms:>15.3f}")
        if self.workers_in_forward:
            lines.append(f"model in worker processes: the phases above are the engine process's view "
                         f"({self.engine_process_fraction:.1%} not waiting); the workers' own forward pass and "
                         f"LM head took {1e3 * self.worker_forward_s / max(self.steps, 1):.2f} ms a step, and "
                         "the overhead below is the rest of each step (the worker's input preparation and "
                         "sampling, the messages, and engine work not hidden behind the forward pass)")
        lines.append(f"{self.steps} steps; engine overhead (all but forward): "
                     f"{self.overhead_fraction:.1%} of step time")
        if self.decode_steps:
            decode_total = self.decode_total_s
            overhead_ms = 1e3 * (decode_total - self.decode_forward_s) / self.decode_steps
            lines.append(f"{self.decode_steps} decode-only steps: engine overhead {self.decode_overhead_fraction:.1%} "
                         f"({overhead_ms:.2f} ms of {1e3 * decode_total / self.decode_steps:.2f} ms a step)")
        return "\n".join(lines)

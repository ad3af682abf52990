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
Python call; on CUDA the forward is asynchronous and its time lands on whichever phase first waits for the
device, so read the split there with care.

The phase timers still cost about a microsecond a call, some of them once per request a step (the
detokenisation's), which at batch 64 is a third of the overhead they measure. So the overhead figure
itself comes from a run with two clocks only (attach(engine, phases=False)): each step's wall time, and
the forward pass and LM head the runner timed itself; `bench throughput --profile` takes it from the
timed run and the phase split from a second run of the same requests.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

PHASES = ("scheduling", "input preparation", "forward", "sampling", "detokenisation", "output processing", "other")
_MISSING = object()


@dataclass
class StepClock:
    """Steps timed by their wall clock alone, beside the forward pass (and LM head) the runner timed."""
    steps: int = 0
    seconds: float = 0.0
    forward_s: float = 0.0

    def add(self, seconds: float, forward_s: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.forward_s += forward_s

    @property
    def overhead_fraction(self) -> float:
        return (self.seconds - self.forward_s) / self.seconds if self.seconds else 0.0

    def describe(self, what: str) -> str:
        overhead_ms = 1e3 * (self.seconds - self.forward_s) / max(self.steps, 1)
        return (f"{self.steps} {what}: engine overhead {self.overhead_fraction:.1%} "
                f"({overhead_ms:.2f} ms of {1e3 * self.seconds / max(self.steps, 1):.2f} ms a step)")


def _is_decode(plan: Any) -> bool:
    """Every request in the plan is past its prompt."""
    return bool(plan.requests) and all(
        start >= request.num_prompt_tokens for request, start in zip(plan.requests, plan.start_pos))


class StepProfiler:
    def __init__(self) -> None:
        # from a run with step and forward clocks only (attach(phases=False)): all steps, decode steps
        self.clock = StepClock()
        self.decode_clock = StepClock()
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

    def attach(self, engine: Any, phases: bool = True) -> StepProfiler:
        """Time `engine`'s steps until detach(): by phase, or (phases=False) by the step and forward clocks
        alone."""
        if not phases:
            return self._attach_clock(engine)
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
                if plan is not None and _is_decode(plan):
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

    def _attach_clock(self, engine: Any) -> StepProfiler:
        core = engine.engine_core
        step, finish_step, clock = engine.step, core._finish_step, time.perf_counter
        applied: list[tuple[Any, float]] = []  # the step's (plan, forward seconds) whose results it applied

        def noted_finish_step(scheduler_output: Any, model_output: Any) -> Any:
            applied.append((scheduler_output, model_output.forward_s))
            return finish_step(scheduler_output, model_output)

        def clocked_step(*args: Any, **kwargs: Any) -> Any:
            applied.clear()
            start = clock()
            try:
                return step(*args, **kwargs)
            finally:
                seconds = clock() - start
                forward_s = sum(forward for _, forward in applied)
                self.clock.add(seconds, forward_s)
                if applied and _is_decode(applied[0][0]):
                    self.decode_clock.add(seconds, forward_s)

        self._replace(core, "_finish_step", noted_finish_step)
        self._replace(engine, "step", clocked_step)
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
    def phase_total_s(self) -> float:
        """The phase run's step time (its timers' own cost included)."""
        return sum(self.seconds.values())

    @property
    def total_s(self) -> float:
        return self.clock.seconds if self.clock.steps else self.phase_total_s

    @property
    def overhead_fraction(self) -> float:
        """Engine overhead's share of step time: all but the forward pass (with workers in other
        processes, all but their own forward pass: see the module docstring). From the clock run where
        there was one."""
        if self.clock.steps:
            return self.clock.overhead_fraction
        return self._phase_overhead(self.phase_total_s, self.forward_s)

    @property
    def decode_overhead_fraction(self) -> float:
        if self.decode_clock.steps:
            return self.decode_clock.overhead_fraction
        return self._phase_overhead(self.decode_total_s, self.decode_forward_s)

    @staticmethod
    def _phase_overhead(total: float, forward: float) -> float:
        return (total - forward) / total if total else 0.0

    @property
    def forward_s(self) -> float:
        """The phase run's forward pass: the workers' own where they run in other processes."""
        return self.worker_forward_s if self.workers_in_forward else self.seconds["forward"]

    @property
    def decode_forward_s(self) -> float:
        """The same over the decode steps."""
        return self.decode_worker_forward_s if self.workers_in_forward else self.decode_seconds["forward"]

    @property
    def engine_process_fraction(self) -> float:
        """With workers in other processes: the engine process's own phases' share of step time (less
        than the overhead on the critical path; with async scheduling mostly hidden behind the forward)."""
        total = self.phase_total_s
        return (total - self.seconds["forward"]) / total if total else 0.0

    @property
    def decode_total_s(self) -> float:
        return sum(self.decode_seconds.values())

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "seconds": {p: self.seconds[p] for p in PHASES},
                "total_s": self.total_s, "overhead_fraction": self.overhead_fraction,
                "decode_steps": self.decode_steps,
                "decode_seconds": {p: self.decode_seconds[p] for p in PHASES},
                "decode_overhead_fraction": self.decode_overhead_fraction,
                "clock": asdict(self.clock), "decode_clock": asdict(self.decode_clock),
                "workers_in_forward": self.workers_in_forward,
                "worker_forward_s": self.worker_forward_s, "decode_worker_forward_s": self.decode_worker_forward_s,
                "engine_process_fraction": self.engine_process_fraction}

    def format(self) -> str:
        lines = []
        if self.steps:
            lines += self._format_phases()
        if self.clock.steps:
            lines.append("the timed run, clocked by step and forward pass only:")
            lines.append(self.clock.describe("steps"))
            if self.decode_clock.steps:
                lines.append(self.decode_clock.describe("decode-only steps"))
        return "\n".join(lines)

    def _format_phases(self) -> list[str]:
        total = self.phase_total_s or float("nan")
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
        timers = " (a run with phase timers, their own cost in the phases)" if self.clock.steps else ""
        lines.append(f"{self.steps} steps{timers}; engine overhead (all but forward): "
                     f"{self._phase_overhead(self.phase_total_s, self.forward_s):.1%} of step time")
        if self.decode_steps:
            decode_total = self.decode_total_s
            overhead_ms = 1e3 * (decode_total - self.decode_forward_s) / self.decode_steps
            lines.append(f"{self.decode_steps} decode-only steps: engine overhead "
                         f"{self._phase_overhead(decode_total, self.decode_forward_s):.1%} "
                         f"({overhead_ms:.2f} ms of {1e3 * decode_total / self.decode_steps:.2f} ms a step)")
        return lines

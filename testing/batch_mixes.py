"""Seeded random mixes of requests through the real Scheduler and executor runner (issue #43).

A mix is a set of requests (shared prefixes, mixed prompt lengths, seeded sampling and greedy,
n > 1, penalties and truncation, log-probs) served under a setup drawn from the same seed: the
step's token budget (prefill chunks beside decode tokens), a pool small enough to preempt (by
recompute or by swap), prefix caching, several decode steps per plan, plans prepared while the
step before runs with two in flight (``--prepare-ahead`` under asynchronous scheduling), compute
threads, speculative decoding, and every request moved to a second executor part way (migration).
:func:`serve` returns each choice's tokens and log-probs; :data:`PLAIN` serves a request by itself
the plainest way. The tests compare the two bit for bit; :class:`MixStats` says what was exercised.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from executor_svc.pipeline import StepPipeline
from executor_svc.runner import ModelRunner
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import BatchPlan, SamplingParams, StepResult
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig

BLOCK = 16
CPU_BLOCKS = 64
Sample = tuple[int, float | None, tuple[int, ...], tuple[float, ...]]  # token, its log-prob, the top ids and log-probs
Context = tuple[str, int, tuple[int, ...]]  # request id, choice, the tokens a logits row was computed after


@dataclass
class Outputs:
    """What a mix produced: each choice's samples (log-probs None when not asked for) and every logits
    row the sampler was given, by the context it followed (a speculative step also scores contexts
    its rejected proposals made, which a plain run never sees)."""

    samples: dict[str, list[list[Sample]]]
    rows: dict[Context, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Setup:
    budget: int = 2048  # --max-num-batched-tokens
    num_blocks: int = 256  # the scheduler's device pool (the runner's may be larger)
    preemption: str = "recompute"
    prefix_caching: bool = True
    decode_steps: int = 1  # --decode-steps (the executor's), taken when every request decodes
    pipelined: bool = False  # --prepare-ahead, two plans in flight (asynchronous scheduling)
    threads: int | None = None  # compute threads (None: as they are)
    speculative: int = 0  # n-gram proposals per step (0: off)
    migrate_at: int | None = None  # after this many steps every request moves to a second executor


PLAIN = Setup()


THEMES = ("swap", "recompute", "speculative", "decode-steps", "ahead", "migrate")


def random_setup(rng: random.Random, theme: str | None = None, single_device: bool = True) -> Setup:
    """A setup for one mix; a ``theme`` (one of THEMES) makes sure of one feature. ``single_device=False``
    (a tensor-parallel group) leaves out what a group does not do (plans prepared ahead, several
    decode steps, speculation) and migration."""
    pipelined = theme == "ahead" or (single_device and theme is None and rng.random() < 0.35)
    speculative = 3 if theme == "speculative" else rng.choice([0, 0, 3]) if single_device and theme is None else 0
    multi = theme == "decode-steps" or (single_device and theme is None and not pipelined and not speculative
                                        and rng.random() < 0.5)
    tight = theme in ("swap", "recompute")
    return Setup(budget=rng.choice([8, 24, 64, 2048]), num_blocks=12 if tight else rng.choice([12, 20, 256]),
                 preemption=theme if tight else rng.choice(["recompute", "swap"]),
                 prefix_caching=tight or rng.random() < 0.8, decode_steps=4 if multi else 1,
                 pipelined=pipelined, threads=rng.choice([1, 2, 3]), speculative=speculative,
                 migrate_at=rng.choice([3, 9]) if theme == "migrate" else
                 rng.choice([None, 3, 9]) if single_device and theme is None else None)


def random_mix(rng: random.Random, vocab: int, theme: str | None = None,
               single_device: bool = True) -> tuple[Setup, dict[str, GenerationRequest]]:
    """A setup and its requests: 2-4 requests when speculating (proposals are made while few decode),
    16 when preempting, else 4-16; none asks for log-probs with several decode steps per plan."""
    setup = random_setup(rng, theme, single_device)
    count = rng.randint(2, 4) if setup.speculative else 16 if theme in ("swap", "recompute") else rng.randint(4, 16)
    want = False if setup.decode_steps > 1 else None
    return setup, random_requests(rng, vocab, count, want)


def random_requests(rng: random.Random, vocab: int, count: int,
                    want_logprobs: bool | None = None) -> dict[str, GenerationRequest]:
    """``count`` requests: most share one of two prefixes (whole blocks, so the cache finds them),
    some repeat a phrase (n-gram proposals find it), greedy or seeded, some with n = 2; all ask for
    log-probs, or none do (plans of several decode steps are for requests that do not)."""
    prefixes = [[rng.randrange(1, vocab) for _ in range(BLOCK * rng.randint(1, 2))] for _ in range(2)]
    want = rng.random() < 0.7 if want_logprobs is None else want_logprobs
    out = {}
    for i in range(count):
        head = rng.choice(prefixes) if rng.random() < 0.7 else []
        tail = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.3:
            phrase = [rng.randrange(1, vocab) for _ in range(4)]
            tail += phrase * 3
        greedy = rng.random() < 0.3
        sampling = SamplingParams(
            temperature=0.0 if greedy else rng.choice([0.6, 1.0, 1.3]),
            top_k=rng.choice([0, 0, 20]), top_p=rng.choice([1.0, 1.0, 0.9]), min_p=rng.choice([0.0, 0.0, 0.05]),
            seed=None if greedy else rng.randrange(1 << 31), repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
            want_logprobs=want, logprobs=rng.choice([0, 2, 5]) if want else 0)
        n = 2 if not greedy and rng.random() < 0.15 else 1
        params = RequestParams(max_tokens=rng.randint(2, 12), sampling=sampling, n=n, ignore_eos=True)
        out[f"r{i}"] = GenerationRequest(f"r{i}", head + tail, params)
    return out


@dataclass
class MixStats:
    steps: int = 0
    preemptions: int = 0
    swapped_blocks: int = 0
    cache_hit_tokens: int = 0
    migrations: int = 0
    mixed_steps: int = 0  # a prefill chunk beside another request's decode token
    decode_batches: int = 0  # pure decode steps of several sequences
    multi_step_plans: int = 0  # plans of several decode steps
    launched_ahead: int = 0  # steps whose inputs included a token still being sampled
    proposals: int = 0  # plans carrying speculative proposals
    most_requests: int = 0  # the most requests one step served
    threads: set[int] = field(default_factory=set)

    def saw(self, plan: BatchPlan, sched: Scheduler) -> None:
        n = plan.num_new_tokens
        self.steps += 1
        self.swapped_blocks += len(plan.swap_out) + len(plan.swap_in)
        self.mixed_steps += len(n) > 1 and max(n) > 1 and min(n) == 1
        self.decode_batches += len(n) > 1 and max(n) == 1 and not plan.proposals
        self.multi_step_plans += plan.decode_steps > 1
        self.proposals += bool(plan.proposals)
        seqs = {sid: sched.seqs.get(sid) for sid in plan.scheduled_seq_ids}
        self.most_requests = max(self.most_requests, len({s.request.request_id for s in seqs.values() if s}))


class _Executor:
    """One executor: a runner and the scheduler of its pool, planned ahead or in order."""

    def __init__(self, runner: ModelRunner, setup: Setup, stats: MixStats, out: Outputs) -> None:
        self.runner, self.setup, self.stats = runner, setup, stats
        runner.reset()
        self._record_rows(runner, out)
        runner.prepare_ahead = setup.pipelined
        runner.max_decode_steps = setup.decode_steps
        spec = SpeculativeConfig(num_speculative_tokens=setup.speculative, prompt_lookup_max=3) \
            if setup.speculative else None
        cfg = SchedulerConfig(block_size=BLOCK, max_num_seqs=32, max_num_batched_tokens=setup.budget,
                              max_model_len=256, preemption_mode=setup.preemption,
                              enable_prefix_caching=setup.prefix_caching,
                              decode_steps=runner.decode_steps_served(), speculative=spec)
        self.sched = Scheduler(cfg, setup.num_blocks, CPU_BLOCKS, eos_token_ids=(),
                               vocab_size=runner.model.cfg.vocab_size)
        self.pipe = StepPipeline(runner) if setup.pipelined else None
        if self.pipe is not None:
            launch = runner.launch

            def counted(step, *args, **kwargs):
                stats.launched_ahead += bool(step.batch is not None and step.batch.in_flight_inputs)
                return launch(step, *args, **kwargs)
            runner.launch = counted

    def _record_rows(self, runner: ModelRunner, out: Outputs) -> None:
        """Every logits row sampled, by context: those the sampler gets (before it edits them in
        place), and those of greedy steps whose tokens were taken on the device (token_chain.py)."""
        sample = type(runner.sampler).sample.__get__(runner.sampler)
        report = type(runner)._report_device_tokens.__get__(runner)

        def record(logits, seqs) -> None:
            for i, s in enumerate(seqs):
                seq = self.sched.seqs.get(s.seq_id)
                if seq is not None:
                    key = (seq.request.request_id, seq.index, tuple(s.token_ids))
                    row = logits[i].clone()
                    old = out.rows.setdefault(key, row)
                    assert torch.equal(old, row), f"{key[:2]}: a context scored twice got other logits"

        def recorded(logits, seqs, masks=None):
            record(logits, seqs)
            return sample(logits, seqs, masks)

        def recorded_on_device(step, result):
            record(step.logits, step.batch.sample_seqs)
            return report(step, result)
        runner.sampler.sample = recorded
        runner._report_device_tokens = recorded_on_device

    def step(self) -> list[StepResult] | None:
        """Plan and run what it can; [] when it waits; None when it has nothing left."""
        sched, pipe = self.sched, self.pipe
        depth = 2 if pipe is not None else 1
        plan = sched.schedule() if len(sched.in_flight) < depth else None
        if plan is not None:
            self.stats.saw(plan, sched)
            return pipe.push(plan) if pipe is not None else [self.runner.execute(plan)]
        if pipe is not None and pipe.in_flight is not None:
            return [pipe.finish()]
        return None if not sched.has_work() else []

    def settle(self) -> list[StepResult]:
        """Every step in flight completed (before the requests move away)."""
        return [self.pipe.finish()] if self.pipe is not None and self.pipe.in_flight is not None else []

    def close(self) -> None:
        self.stats.preemptions += self.sched.num_preemptions
        self.stats.cache_hit_tokens += self.sched.prefix_cache_hit_tokens
        self.runner.__dict__.pop("launch", None)  # (the wrappers)
        self.runner.__dict__.pop("_report_device_tokens", None)
        self.runner.sampler.__dict__.pop("sample", None)


def serve(runners: Callable[[], ModelRunner], reqs: dict[str, GenerationRequest], setup: Setup = PLAIN,
          stats: MixStats | None = None, max_steps: int = 5000) -> Outputs:
    """Serve ``reqs`` to the end under ``setup``; ``runners()`` gives an executor's runner (called
    again for the executor a migration moves the requests to)."""
    stats = stats if stats is not None else MixStats()
    out = Outputs({rid: [[] for _ in range(r.params.n)] for rid, r in reqs.items()})
    threads = torch.get_num_threads()
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
        stats.threads.add(setup.threads)
    ex = _Executor(runners(), setup, stats, out)
    try:
        for req in reqs.values():
            ex.sched.add_request(req)
        first = stats.steps
        for _ in range(max_steps):
            if setup.migrate_at is not None and stats.steps - first == setup.migrate_at and ex.sched.has_work():
                ex = _migrate(ex, runners, setup, stats, out)
            results = ex.step()
            if results is None:
                ex.close()
                return out
            for result in results:
                _take(ex.sched, result, out)
        raise AssertionError("the mix did not finish")
    finally:
        torch.set_num_threads(threads)


def _migrate(ex: _Executor, runners: Callable[[], ModelRunner], setup: Setup, stats: MixStats,
             out: Outputs) -> _Executor:
    """Every request taken from ``ex`` (its steps in flight completed) and queued, with the tokens it
    has, on a new executor, as the engine does when an executor is lost."""
    for result in ex.settle():
        _take(ex.sched, result, out)
    moved = ex.sched.take_all_requests()
    ex.close()
    stats.migrations += 1
    new = _Executor(runners(), setup, stats, out)
    for m in moved:
        new.sched.add_request(m.request, resume=m if any(m.outputs) else None)
    return new


def _take(sched: Scheduler, result: StepResult, out: Outputs) -> None:
    assert result.error is None and not result.refused, result.error
    for upd in sched.update(result):
        assert upd.error is None, upd.error
        for s in upd.seqs:
            if s.logprobs is None:
                samples = [(t, None, (), ()) for t in s.new_token_ids]
            else:
                assert len(s.logprobs) == len(s.new_token_ids), "every token reports its log-probs"
                samples = [(t.token_id, t.logprob, tuple(t.top_token_ids), tuple(t.top_logprobs)) for t in s.logprobs]
            out.samples[upd.request_id][s.index] += samples
    sched.check_integrity()


def first_difference(got: Outputs, ref: Outputs) -> str | None:
    """Where ``got`` departs from ``ref`` (None: bit-identical): every sample, and the logits row
    of every context ``ref`` scored (``got`` must have scored it too)."""
    for rid, choices in ref.samples.items():
        for i, want in enumerate(choices):
            have = got.samples[rid][i]
            if have == want:
                continue
            at = next((j for j, (a, b) in enumerate(zip(have, want, strict=False)) if a != b), min(len(have), len(want)))
            a, b = (have[at] if at < len(have) else None), (want[at] if at < len(want) else None)
            return f"{rid} choice {i} output {at}: {a} in the mix, {b} alone"
    for key, row in ref.rows.items():
        mine = got.rows.get(key)
        if mine is None or not torch.equal(mine, row):
            where = f"{key[0]} choice {key[1]} after {len(key[2])} tokens"
            return f"{where}: never scored" if mine is None else \
                f"{where}: logits differ by up to {float((mine - row).abs().max())}"
    return None

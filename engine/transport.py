"""How the engine steps its ranks each iteration: ordinary actor calls, or one Ray Compiled Graph execution.

`KVFLEET_STEP_TRANSPORT` picks one. Both give one entry per rank: its StepResult, the exception its step
raised (a `ray.exceptions.RayActorError` when the rank is gone), or None when it was not stepped.

The compiled graph (`ray.dag`, shared-memory channels) holds every live rank; a rank whose plan is None is
still in it but its task returns None at once without touching the rank (leaving it out would mean
compiling again). Ranks step through `__ray_call__` with `_graph_step`, which never raises (an
exception in one task would become every rank's result) and keeps its last result on the rank. When a rank
dies Ray tears the whole graph down and every output is lost, so the transport asks each rank over an
ordinary call what it did in that execution: a dead rank answers with RayActorError, a live one with the
result it kept, and a live one the execution never reached steps then, over an ordinary call. The ranks
then step without the dead ones, in a graph compiled again on the next step (or over `replace()`'s ranks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle

from workers.step import StepPlan, StepResult

log = logging.getLogger("kvfleet.engine")

STEP_TRANSPORTS = ("compiled_graph", "actor_calls")
# An execution that has not answered by then counts as failed (a rank hung): the graph is torn down and the
# ranks that do not answer either are reported unavailable. Compiled Graph's own get timeout does not apply
# to asyncio executions, so this is the one that does.
STEP_TIMEOUT_S = 300.0
RECOVER_TIMEOUT_S = 30.0

Outcome = StepResult | BaseException | None


class Transport(Protocol):
    pipelined: bool  # submit() sends at once, behind any step still running: async scheduling may send ahead

    async def step(self, plans: list[StepPlan | None]) -> list[Outcome]: ...

    def submit(self, plans: list[StepPlan | None]) -> Awaitable[list[Outcome]]: ...

    def replace(self, workers: list[ActorHandle | None]) -> None: ...

    async def close(self) -> None: ...


@dataclass
class StepFailure:
    """A rank's step raised: `rank_gone` when the actor itself is dead or unreachable."""

    rank: int
    error: BaseException

    @property
    def rank_gone(self) -> bool:
        return isinstance(self.error, ray.exceptions.RayActorError)


def send_step(transport: Any, world_size: int, plans: list[StepPlan | None],
              tp: int) -> asyncio.Future[tuple[list, list, tuple[int, ...]]]:
    """Send every rank of each dp group that has a plan its group's plan, now (a pipelined transport queues it
    behind a step still running). The future gives, per group: tp rank 0's result (with every tp rank's failed
    requests), or the failure of a rank whose step raised (a dead rank first), or None; then every rank's stats
    delta, and the ranks that gave none (not stepped, or failed)."""
    answers = transport.submit([plans[r // tp] for r in range(world_size)])
    return asyncio.ensure_future(_collect(answers, world_size, plans, tp))


async def _collect(answers: Awaitable[list[Outcome]], world_size: int, plans: list[StepPlan | None],
                   tp: int) -> tuple[list, list, tuple[int, ...]]:
    stepped = [rank for rank in range(world_size) if plans[rank // tp] is not None]
    answers = await answers
    outs = [answers[r] for r in stepped]
    results: list = [None] * len(plans)
    deltas = [out.delta for out in outs if isinstance(out, StepResult) and out.delta is not None]
    reported = {d.rank for d in deltas}
    missing = tuple(r for r in range(world_size) if r not in reported)
    for rank, out in zip(stepped, outs, strict=True):
        dp, cur = rank // tp, results[rank // tp]
        if isinstance(out, BaseException):
            fail = StepFailure(rank, out)
            if not isinstance(cur, StepFailure) or (fail.rank_gone and not cur.rank_gone):
                results[dp] = fail
        elif cur is None:
            results[dp] = out
        elif isinstance(cur, StepResult):
            cur.failed.update(out.failed)
    return results, deltas, missing


def make_transport(kind: str, workers: list[ActorHandle | None]) -> Transport:
    """`workers[r]` is rank r's actor, or None while its dp group is down."""
    if kind == "compiled_graph":
        return CompiledGraph(workers)
    if kind == "actor_calls":
        return ActorCalls(workers)
    raise ValueError(f"unknown step transport {kind!r}: expected one of {', '.join(STEP_TRANSPORTS)}")


def _no_actor(rank: int) -> ray.exceptions.RayActorError:
    return ray.exceptions.RayActorError(error_msg=f"rank {rank} has no actor (its dp group is down)")


class ActorCalls:
    """One `step.remote(plan)` per stepped rank, gathered: the driver's work grows with the ranks stepped. A rank
    runs its calls in the order sent, so a step sent before the last one's result is back queues behind it."""

    pipelined = True

    def __init__(self, workers: list[ActorHandle | None]) -> None:
        self.workers = list(workers)

    async def step(self, plans: list[StepPlan | None]) -> list[Outcome]:
        return await self.submit(plans)

    def submit(self, plans: list[StepPlan | None]) -> asyncio.Future[list[Outcome]]:
        """Send every rank its plan now (`.remote()` here, not in a task that starts later: the order of the
        steps sent is the order they run in); the future gathers the answers."""
        ranks = [r for r, p in enumerate(plans) if p is not None]
        calls = [asyncio.ensure_future(self._call(r, plans[r])) for r in ranks]

        async def gather() -> list[Outcome]:
            out: list[Outcome] = [None] * len(plans)
            for r, res in zip(ranks, await asyncio.gather(*calls, return_exceptions=True), strict=True):
                out[r] = res
            return out

        return asyncio.ensure_future(gather())

    def _call(self, rank: int, plan: StepPlan) -> Awaitable[StepResult]:
        if self.workers[rank] is None:
            return _raise(_no_actor(rank))
        try:
            return self.workers[rank].step.remote(plan)
        except Exception as e:  # an answer like any other: the step loop judges it
            return _raise(e)

    def replace(self, workers: list[ActorHandle | None]) -> None:
        self.workers = list(workers)

    async def close(self) -> None:
        self.workers = []


# ---- runs on the rank (through __ray_call__, on Compiled Graph's execution thread) ------------------------
_NOT_STEPPED = "not-stepped"


class _Kept:
    """A rank's answer to its last graph execution, for `_kept_step` should the graph fail. Module state of the
    rank's process (a Ray actor is one process), so the transport keeps its own, not the worker's, attributes."""

    lock = threading.Lock()
    seq: int | None = None
    answer: Outcome = None


def _graph_step(worker: Any, seq: int, plan: StepPlan | None) -> bytes | None:
    """Step the rank and keep what it answered under `seq`.

    The answer goes back pickled: the graph would hand numpy arrays (the stats delta's row) to the engine
    zero-copy, as views of its channel buffers, which the engine keeps past the execution (and past
    ray.shutdown(), where freeing them crashes the process)."""
    if plan is None:
        return None
    with _Kept.lock:
        try:
            res: Outcome = worker.step(plan)
        except Exception as e:  # returned, not raised: a raising task fails every rank's output
            res = e
        _Kept.seq, _Kept.answer = seq, res
    return pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)


def _kept_step(worker: Any, seq: int, timeout_s: float) -> Outcome | str:
    """What the rank answered in execution `seq`, or _NOT_STEPPED; waits for a step still running."""
    if not _Kept.lock.acquire(timeout=timeout_s):
        raise TimeoutError(f"the rank's step of execution {seq} is still running after {timeout_s:.0f} s")
    try:
        return _Kept.answer if _Kept.seq == seq else _NOT_STEPPED
    finally:
        _Kept.lock.release()


async def _raise(error: BaseException) -> Any:
    raise error


class CompiledGraph:
    """One compiled graph over the live ranks; one `execute_async` per step. Not pipelined: its recovery
    (`_recover`) asks the ranks about one execution at a time."""

    pipelined = False

    def __init__(self, workers: list[ActorHandle | None], timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.workers = list(workers)
        self.timeout_s = timeout_s
        self.graph: Any = None  # ray.dag.CompiledDAG while compiled
        self._members: list[int] = []  # the ranks in the graph, in its output order
        self._loop_ended: asyncio.Future | None = None  # done when any rank's graph loop ends (a rank died)
        self._seq = 0
        self._stale = False  # set by replace(): the graph is over ranks that are no longer the live ones

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        self._members = [r for r, w in enumerate(self.workers) if w is not None]
        with InputNode() as inp:  # input: (seq, plan of each member)
            outs = [self.workers[r].__ray_call__.bind(_graph_step, inp[0], inp[i + 1])
                    for i, r in enumerate(self._members)]
            dag = MultiOutputNode(outs)
        self.graph = dag.experimental_compile(enable_asyncio=True, _submit_timeout=self.timeout_s)
        loops = [asyncio.wrap_future(ref.future()) for ref in self.graph.worker_task_refs.values()]
        for f in loops:  # a dead rank's loop ends with its ActorDiedError: seen, not logged as unretrieved
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._loop_ended = asyncio.ensure_future(asyncio.wait(loops, return_when=asyncio.FIRST_COMPLETED))
        log.info("compiled the step graph over ranks %s", self._members)

    def submit(self, plans: list[StepPlan | None]) -> asyncio.Future[list[Outcome]]:
        return asyncio.ensure_future(self.step(plans))

    async def step(self, plans: list[StepPlan | None]) -> list[Outcome]:
        out: list[Outcome] = [None] * len(plans)
        for r, p in enumerate(plans):
            if p is not None and self.workers[r] is None:
                out[r] = _no_actor(r)
        if not any(plans[r] is not None for r, w in enumerate(self.workers) if w is not None):
            return out
        if self._stale:  # the ranks changed since the graph was compiled (no execution runs now)
            self._stale = False
            await self._close_graph()
        if self.graph is None:
            self._compile()
        self._seq += 1
        seq, members = self._seq, self._members
        try:
            results = await asyncio.wait_for(self._execute(seq, [plans[r] for r in members]), self.timeout_s)
        except Exception as e:
            log.warning("step graph execution %d failed (%s): asking each rank what it did", seq, e)
            results = await self._recover(seq, members, [plans[r] for r in members])
        for r, res in zip(members, results, strict=True):
            out[r] = res if plans[r] is not None else None
        return out

    async def _execute(self, seq: int, plans: list[StepPlan | None]) -> list[Outcome]:
        """The execution's outputs; raises when a rank's graph loop ends first. (When Ray tears a graph down
        for a dead rank between the write and the read, the execution's future is never resolved.)"""
        futs = await self.graph.execute_async(seq, *plans)

        async def read() -> list:
            return [await f for f in futs]  # one read serves all: the first await fetches every output

        reading = asyncio.ensure_future(read())
        try:
            await asyncio.wait([reading, self._loop_ended], return_when=asyncio.FIRST_COMPLETED)
        finally:
            read_all = reading.done()
            if not read_all:  # a rank's loop ended, or the step itself was cancelled (shutdown)
                reading.cancel()
        if not read_all:
            raise RuntimeError("a rank's graph loop ended during the execution")
        return [None if out is None else pickle.loads(out) for out in reading.result()]

    async def _recover(self, seq: int, members: list[int], plans: list[StepPlan | None]) -> list[Outcome]:
        """After a failed execution: tear the graph down (so no rank is mid-step), then each rank's answer to
        execution `seq`; a live rank the execution never reached steps now, over an ordinary call."""
        await self._close_graph()

        async def answer(r: int, plan: StepPlan | None) -> Outcome:
            ref = self.workers[r].__ray_call__.remote(_kept_step, seq, RECOVER_TIMEOUT_S)
            try:
                kept = await asyncio.wait_for(ref, RECOVER_TIMEOUT_S + 10)
            except ray.exceptions.RayActorError:
                raise
            except Exception as e:  # no answer: counted as gone, as a hung rank is
                raise ray.exceptions.ActorUnavailableError(f"rank {r} did not answer: {e!r}", None) from e
            if kept != _NOT_STEPPED or plan is None:
                return kept
            return await self.workers[r].step.remote(plan)

        results = await asyncio.gather(*map(answer, members, plans), return_exceptions=True)
        for r, res in zip(members, results, strict=True):
            if isinstance(res, ray.exceptions.RayActorError):
                self.workers[r] = None  # gone: the next graph is compiled without it
        return results

    async def _close_graph(self) -> None:
        """Tear down on the loop's own thread (the graph's reader and writer are tasks of this loop), then let
        those tasks finish: a graph object left to the garbage collector after ray.shutdown() crashes it."""
        self._teardown()
        for _ in range(3):
            await asyncio.sleep(0)

    def _teardown(self) -> None:
        """Blocks until every rank's graph loop has exited: milliseconds, up to Ray's teardown timeout (30 s)
        for a rank that hangs mid-step."""
        graph, self.graph = self.graph, None
        if graph is None:
            return
        if self._loop_ended is not None:
            self._loop_ended.cancel()
        with contextlib.suppress(Exception):
            graph.teardown()
        # Ray 2.60's asyncio input writer does not stop its thread on close (the reader does): stop it here,
        # or each recompile leaves an idle thread behind
        pool = getattr(getattr(graph, "_dag_submitter", None), "_background_task_executor", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def replace(self, workers: list[ActorHandle | None]) -> None:
        """The live ranks changed: the next step tears the graph down and compiles one over `workers`. Not
        here: a group's restart calls this while an execution may be in flight, which must finish first."""
        self.workers = list(workers)
        self._stale = True

    async def close(self) -> None:
        await self._close_graph()
        self.workers = []

"""The real Engine over in-process ranks (no Ray): each rank is a RankWorker whose step runs in the loop."""

import asyncio
import types

import torch

from deployment.settings import Settings
from engine import ranks
from engine.config import EngineConfig
from engine.core import Engine
from engine.transport import make_transport
from kvcache.events import partial_reuse_worth, reuse_table
from workers.loader import load_model
from workers.parallel import TPGroup
from workers.step import RankSpec
from workers.worker import RankWorker, build_kv_cache, layout_of

_MODEL: dict = {}


class LocalRank:
    """A rank called like an actor handle (`rank.step.remote(plan)`); `fail(plan)` may raise to inject faults."""

    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.fail = None

        async def step(plan):
            await asyncio.sleep(0)
            if self.fail is not None:
                self.fail(plan)
            return worker.step(plan)

        self.step = types.SimpleNamespace(remote=step)


def make_rank(c: EngineConfig, rank: int) -> RankWorker:
    spec = RankSpec(engine_id=c.engine_id, rank=rank, dp=c.dp, tp=c.tp, model=c.model, device="cpu",
                    dtype="float32", seed=c.seed, cache=c.cache, max_num_batched_tokens=c.max_num_batched_tokens,
                    simulation=c.simulation)
    w = RankWorker(spec)
    key = (c.model, c.simulation)
    if key not in _MODEL:
        _MODEL[key] = load_model(c.model, seed=c.seed, max_seq_len=c.cache.max_seq_len, simulation=c.simulation)
    w.model, cfg = _MODEL[key]
    w.kv = build_kv_cache(spec, cfg, "cpu", torch.float32, TPGroup(spec.tp_rank, 1, None, "", 0), w.model)
    w.layout = layout_of(w.kv, spec, w.incarnation, node_id="local")
    return w


def longest_request(w: RankWorker) -> int:
    n = w.spec.cache.max_seq_len
    while not w.kv.fits(n, w.spec.max_num_batched_tokens):
        n -= 1
    return n


def setup_info(w) -> dict:
    """What a rank's setup tells the engine (RankWorker.setup), of what the engine reads."""
    return {"layout": w.layout, "max_request_tokens": longest_request(w), "kv_slots": w.kv.num_slots,
            "max_num_blocks": w.kv.get_kv_cache_stats().max_num_blocks}


async def make_engine(**overrides) -> Engine:
    """An engine stepping in the running loop; `engine.ranks` are the LocalRanks, `engine.rank_workers` theirs."""
    base = dict(model="random", engine_id="local", dp=1, tp=1, device="cpu", max_seq_len=256, kv_cache_bytes=512 << 10,
                host_cache_bytes=0, max_num_batched_tokens=48, seed=0, tokens_per_block=16, restart_backoff_s=0)
    s = Settings(**{**base, **overrides}).engine_config()
    eng = Engine(s)
    eng.rank_workers = [make_rank(s, r) for r in range(s.dp * s.tp)]
    eng.workers = [LocalRank(w) for w in eng.rank_workers]
    eng._pgs = [None] * s.dp
    eng.launches = []  # (dp, its new LocalRanks) per restart; `eng.on_launch(dp, ranks)` may inject faults
    eng.on_launch = None

    async def launch(dp: int) -> ranks.Launched:
        workers = [make_rank(s, r) for r in range(dp * s.tp, (dp + 1) * s.tp)]
        local = [LocalRank(w) for w in workers]
        eng.launches.append((dp, local))
        if eng.on_launch is not None:
            eng.on_launch(dp, local)
        eng.rank_workers[dp * s.tp:(dp + 1) * s.tp] = workers
        return ranks.Launched(None, local, [setup_info(w) for w in workers])

    eng._launch = launch
    eng.transport = make_transport("actor_calls", eng.workers)  # LocalRank answers step.remote like an actor
    eng._stop = lambda workers, pgs: None
    for dp in range(s.dp):  # what Engine.start takes from the ranks' setup
        eng._set_limit(dp, [{"max_request_tokens": longest_request(w)} for w in eng.rank_workers[dp * s.tp:][:s.tp]])
    eng.vocab_size = eng.rank_workers[0].model.config.vocab_size
    eng.placement.reuse_table = reuse_table(eng.rank_workers[0].kv)  # what Engine.start takes from the ranks' setup
    eng.placement.partial_worth = partial_reuse_worth(eng.rank_workers[0].kv)
    for dp in range(s.dp):
        eng.hub.group_started(dp, setup_info(eng.rank_workers[dp * s.tp]))
    eng.hub.publisher.start()  # what Engine.start does first (a no-op unless kv_events_publisher is zmq)
    eng._loop_task = asyncio.get_running_loop().create_task(eng._loop())
    return eng


async def generate(eng: Engine, prompt: list[int], **params) -> list[int]:
    from workers.sampling_params import SamplingParams

    return [ev.token_id async for ev in eng.generate(None, prompt, SamplingParams(**params))]


async def until(cond, what: str = "the condition", turns: int = 100_000) -> None:
    """Let the loop run (restarts, steps) until `cond()` holds; fail after `turns` loop turns."""
    for _ in range(turns):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never held")


async def settled(eng: Engine) -> None:
    """Until the engine has nothing left to step (the closes of finished requests included)."""
    for _ in range(10_000):
        if not eng._wake.is_set():
            return
        await asyncio.sleep(0)
    raise AssertionError("the engine kept stepping")

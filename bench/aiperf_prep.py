"""What AIPerf needs to replay a Mooncake trace against `random` or `simulated` replicas as our load generator
does: the trace scaled as `deployment/clients/trace.py` scales it, and a tokenizer that counts as the byte
tokenizer does (one token a printable character), so AIPerf's prompts have the lengths the trace says.

    python bench/aiperf_prep.py --trace ../shared/traces/mooncake_conversation_trace.jsonl --limit 300 \\
        --scale 0.125 --speed 2 --out /tmp/aiperf-in

writes `/tmp/aiperf-in/trace.jsonl` (lengths x scale, timestamps / speed) and the tokenizer as a Hugging Face
cache entry, `kvfleet/bytes` under `/tmp/aiperf-in/hf` (AIPerf loads a tokenizer by repo id; offline it reads the
cache), and prints the `aiperf profile` command (AIPerf in its own venv, never the project's).
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from deployment.clients.trace import MOONCAKE_BLOCK, scaled_length

PRINTABLE = [chr(c) for c in range(33, 127)] + [" "]


def write_tokenizer(path: Path) -> None:
    """A character tokenizer over printable ASCII: AIPerf draws its prompts' tokens from it, and each is one
    byte, one token of ours."""
    tok = Tokenizer(WordLevel({c: i for i, c in enumerate(PRINTABLE)} | {"[UNK]": len(PRINTABLE)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "unk_token": "[UNK]", "model_max_length": 1 << 20}))


TOKENIZER_REPO = "kvfleet/bytes"
REVISION = "0" * 40


def write_cached_tokenizer(hub_cache: Path) -> None:
    """The tokenizer as the Hugging Face cache holds a repo's snapshot (what an offline load resolves)."""
    repo = hub_cache / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    write_tokenizer(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)


def write_trace(src: str, dst: Path, limit: int | None, scale: float, speed: float) -> int:
    n = 0
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            if limit is not None and n >= limit:
                break
            d = json.loads(line)
            d["input_length"] = scaled_length(d["input_length"], len(d["hash_ids"]), round(MOONCAKE_BLOCK * scale),
                                              scale)
            d["output_length"] = max(1, round(d["output_length"] * scale))
            d["timestamp"] = round(d["timestamp"] / speed)
            out.write(json.dumps(d) + "\n")
            n += 1
    return n


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--out", default="/tmp/aiperf-in")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="simulated", help="the served model name")
    a = ap.parse_args()
    out = Path(a.out)
    write_cached_tokenizer(out / "hf")
    n = write_trace(a.trace, out / "trace.jsonl", a.limit, a.scale, a.speed)
    print(f"{n} requests in {out / 'trace.jsonl'}; run:")
    print(f"HF_HUB_OFFLINE=1 HF_HUB_CACHE={out / 'hf'} "
          f"aiperf profile --model {a.model} --url {a.url} --endpoint-type completions --streaming "
          f"--input-file {out / 'trace.jsonl'} --custom-dataset-type mooncake_trace --fixed-schedule "
          f"--fixed-schedule-auto-offset --tokenizer {TOKENIZER_REPO} "
          f"--isl-block-size {round(MOONCAKE_BLOCK * a.scale)} --use-server-token-count "
          f"--extra-inputs ignore_eos:true --artifact-dir {out / 'artifacts'}")

"""workers: the model, the rank actors and the engine that steps them in lockstep. No HTTP.

Modules, lowest first:
- `config`: `ModelConfig`, a model's shape read from a Hugging Face `config.json` (per-layer windows).
- `parallel`: the tp group (`torch.distributed`, NCCL or gloo, own rendezvous) and the parallel linears.
- `paged_batch`: one forward pass's sequences and the block-table plans paged attention reads through.
- `model`: the decoder (Llama / Qwen2 / Qwen3 / Mistral family) with attention paged through `kvcache`.
- `sampling`: `SamplingParams` and the batched sampler (greedy, temperature, top-k, top-p, seeds).
- `tokenizer`: the byte tokenizer and `tokenizer.json`, chat templates, the incremental detokenizer.
- `gguf_model`, `gguf_tokenizer`: a GGUF file's config, dequantized weights and tokenizer (SmolLM2 default).
- `loader`: loads a model directory or the built-in random model, each tp rank its slice; KV cache sizing.
- `worker`: `RankWorker`, one rank's actor (model shard + KV cache manager); returns its stats delta per step.
- `ranks`: an engine's rank actors, one placement group per dp group: start, tp rendezvous, warm-up, stop.
- `transport`: how the ranks are stepped each iteration: actor calls, or one Ray Compiled Graph execution.
- `scheduler`: a dp group's queues, the rule that plans its step, and how its result moves the requests on.
- `kv_index`, `kv_stream`, `placement`: the engine's block index from the ranks' KV events, the /kv_events
  stream, and the router that places each request on a dp group (kv, least_loaded, round_robin).
- `kv_publisher`: the same KV events over ZMQ in vLLM 0.33's wire format (PUB + replay socket per dp group).
- `recovery`: a down dp group's restart with backoff, and the requests that wait while no group is up.
- `engine`: `Engine`, the step loop over dp groups; admits and places requests, handles failed ranks.
- `stats_channel`: the engine's end of the stats channel: iterations to the aggregator until acknowledged.
- `errors`: the request rules and `RequestError` (400), `RequestFailed` (500), `EngineError` (503),
  `Overloaded` (429); no torch.
"""

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
- `ranks`: an engine's rank actors, one placement group per dp group: start, tp rendezvous, stop.
- `scheduler`: a dp group's queues and the rule that plans its step (decodes first, then prefill chunks).
- `engine`: `Engine`, the step loop over dp groups; places requests, handles failed requests and ranks.
- `stats_channel`: the engine's end of the stats channel: iterations to the aggregator until acknowledged.
- `errors`: the request rules and `RequestError` (400), `RequestFailed` (500), `EngineError` (503); no torch.
"""

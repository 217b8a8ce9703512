"""The engine's own logprobs for `check --reference engine`: a plain vLLM engine (the whole
model, nothing captured) with the settings the output was extracted with, asked for the top-k
logprobs at every prompt position (a prefill), and for outputs with generated rows also for
the logprobs of a greedy generation of the response (decode steps)."""

from __future__ import annotations

Logprobs = list[dict[int, float] | None]  # per prompt position t: {token id: logprob of it at t}; t=0: None
# a greedy generation: (the tokens it generated, per generated token j {token id: logprob at j})
Decoded = tuple[list[int], list[dict[int, float]]]
RAW = "raw_logprobs"  # the sampler's logprobs before any logits processor, as prompt logprobs are


def prompt_logprobs(model: str, cli_args: list[str], prompts: list[list[int]],
                    k: int) -> tuple[list[Logprobs], list[Logprobs]]:
    """For each prompt, vLLM's logprobs at each position t >= 1 of the prompt's own token and
    of the k most likely tokens there (as computed from positions 0 .. t-1): twice, once with
    every prompt in flight together and once with each prompt alone. The two differ by what
    batching alone moves (other kernel shapes and split points): the engine's own noise, the
    yardstick for states captured in yet another batch."""
    together, alone, _ = prompt_and_decode_logprobs(model, cli_args, prompts, k, [None] * len(prompts))
    return together, alone


def prompt_and_decode_logprobs(model: str, cli_args: list[str], prompts: list[list[int]], k: int,
                               num_prompt: list[int | None]) -> tuple[list[Logprobs], list[Logprobs],
                                                                      list[Decoded | None]]:
    """prompt_logprobs of `prompts`, and in the same engine, for each prompt i whose
    num_prompt[i] is neither None nor its whole length (else None in its place): a greedy
    generation (temperature 0, EOS ignored) of len(prompts[i]) - num_prompt[i] tokens from its
    first num_prompt[i] tokens, all such requests in flight together, with the top-k logprobs
    (and the generated token's) of each generated token. A generated token's logprobs come from
    the engine's decode step (the first's from the prompt's prefill): the way an `extract
    --generate` response was computed, while the prompt logprobs of the whole sequence are one
    prefill."""
    from vllm import SamplingParams

    from vllm_hidden.engine import compat
    from vllm_hidden.engine.args import engine_args

    if len(num_prompt) != len(prompts):
        raise ValueError(f"{len(num_prompt)} prompt lengths for {len(prompts)} prompts")
    for p, n in zip(prompts, num_prompt):
        if n is not None and not 0 < n <= len(p):
            raise ValueError(f"prompt length {n!r} of a sequence of {len(p)} tokens")
    compat.check_version()
    compat.spawn_on_cuda()
    args = engine_args(model, cli_args, max(map(len, prompts)))
    args.max_logprobs = max(k, args.max_logprobs or 0)
    mode = compat.logprobs_mode(args)
    if mode not in (None, RAW):
        raise ValueError(f"--logprobs-mode {mode!r}: the check compares log-softmaxed logits "
                         f"before any processor, vLLM's {RAW!r}")
    compat.set_logprobs_mode(args, RAW)  # raw is vLLM's default (prompt logprobs are raw in any mode): set, not assumed
    engine = compat.start_engine(args)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=k)
    got: dict[str, Logprobs] = {}
    decoded: dict[str, Decoded] = {}

    def run() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                if out.request_id.startswith("decode-"):
                    o = out.outputs[0]
                    decoded[out.request_id] = ([int(t) for t in o.token_ids],
                                               [{int(t): float(lp.logprob) for t, lp in d.items()}
                                                for d in o.logprobs])
                else:
                    got[out.request_id] = [None if d is None else {int(t): float(lp.logprob) for t, lp in d.items()}
                                           for d in out.prompt_logprobs]

    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"together-{i}", {"prompt_token_ids": p}, sp)
        run()
        for i, p in enumerate(prompts):
            engine.add_request(f"alone-{i}", {"prompt_token_ids": p}, sp)
            run()
        # every response in flight together, as the extract's decode steps batch many requests
        for i, (p, n) in enumerate(zip(prompts, num_prompt)):
            if n is not None and n < len(p):
                gen = SamplingParams(max_tokens=len(p) - n, temperature=0.0, detokenize=False, logprobs=k,
                                     ignore_eos=True)
                engine.add_request(f"decode-{i}", {"prompt_token_ids": p[:n]}, gen)
        run()
    finally:
        compat.shutdown_engine(engine)
    return ([got[f"together-{i}"] for i in range(len(prompts))], [got[f"alone-{i}"] for i in range(len(prompts))],
            [decoded.get(f"decode-{i}") for i in range(len(prompts))])

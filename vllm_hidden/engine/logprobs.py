"""The engine's own prompt logprobs for `check --reference engine`: a plain vLLM engine (the
whole model, nothing captured) with the settings the output was extracted with, asked for
the top-k logprobs at every prompt position."""

from __future__ import annotations

Logprobs = list[dict[int, float] | None]  # per prompt position t: {token id: logprob of it at t}; t=0: None


def prompt_logprobs(model: str, cli_args: list[str], prompts: list[list[int]],
                    k: int) -> tuple[list[Logprobs], list[Logprobs]]:
    """For each prompt, vLLM's logprobs at each position t >= 1 of the prompt's own token and
    of the k most likely tokens there (as computed from positions 0 .. t-1): twice, once with
    every prompt in flight together and once with each prompt alone. The two differ by what
    batching alone moves (other kernel shapes and split points): the engine's own noise, the
    yardstick for states captured in yet another batch."""
    from vllm import SamplingParams

    from vllm_hidden.engine import compat
    from vllm_hidden.engine.args import engine_args

    compat.check_version()
    compat.spawn_on_cuda()
    args = engine_args(model, cli_args, max(map(len, prompts)))
    args.max_logprobs = max(k, args.max_logprobs or 0)
    engine = compat.start_engine(args)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=k)
    got: dict[str, Logprobs] = {}

    def run() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = [None if d is None else {int(t): float(lp.logprob) for t, lp in d.items()}
                                           for d in out.prompt_logprobs]

    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"together-{i}", {"prompt_token_ids": p}, sp)
        run()
        for i, p in enumerate(prompts):
            engine.add_request(f"alone-{i}", {"prompt_token_ids": p}, sp)
            run()
    finally:
        compat.shutdown_engine(engine)
    return [got[f"together-{i}"] for i in range(len(prompts))], [got[f"alone-{i}"] for i in range(len(prompts))]

"""vLLM's token-in, token-out ``/inference/v1/generate`` wire format, both ways.

Requests carry the prompt as token ids and come back as token ids (``output_mode =
"tokens"``: nothing is detokenized or retokenized). The log-prob of each sampled token is the
one vLLM sampled from when the server runs with ``--logprobs-mode processed_logprobs``: after
temperature, top-k, top-p and min-p, renormalized over the kept set, as furlong's own engine
reports it. Each choice says which weight versions produced its tokens
(``weight_versions``: spans over the output); a result made under two versions is refused
here, so a mixed rollout can never reach a trainer.

furlong's stop rule is explicit: ``stop_token_ids`` (or the model's EOS ids, resolved by the
caller) with ``ignore_eos``, so vLLM and the embedded engine stop on the same ids.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from furlong.errors import InputError
from furlong.rollout.base import FinishReason, GenerateResult
from furlong.rollout.sampling import SamplingParams

# Asked of furlong's SamplingParams but not carried by this client: what the loop or the
# service would replay, said before anything is sent (the embedded engine provides each).
UNSUPPORTED = {
    "return_sampling_mask": "the kept sets for sampling-mask replay (CSR)",
    "return_routed_experts": "MoE routes for routing replay (R3)",
    "prompt_target_ids": "log-probs of named prompt ids",
}
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def served_id(request_id: str) -> str:
    """The id vLLM's engine knows a ``/inference/v1/generate`` request by (what
    ``/abort_requests`` takes): the route prefixes the caller's."""
    return f"generate-tokens-{request_id}"


def check_supported(index: int, params: SamplingParams) -> None:
    """An :class:`InputError` naming the first option vLLM's kind does not carry."""
    for name, what in UNSUPPORTED.items():
        value = getattr(params, name)
        if value is not None and value is not False:
            raise InputError(
                f"params[{index}].{name}: {what} come from the embedded engine; "
                'rollout.engine = "vllm" does not return them (use "embedded")'
            )


def request_body(
    prompt: Sequence[int],
    params: SamplingParams,
    eos_ids: Collection[int],
    request_id: str | None = None,
) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body for one prompt and one sample."""
    stop_ids = sorted(eos_ids) if params.stop_token_ids is None else list(params.stop_token_ids)
    sampling: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else 0,
        "min_p": float(params.min_p),
        "ignore_eos": True,  # furlong's stop ids below are the whole rule
        "stop_token_ids": stop_ids,
        # vLLM 0.32 lists the sampled token, then ranks 1 .. logprobs - 1
        "logprobs": int(params.top_logprobs) + 1 if params.top_logprobs else 0,
        "detokenize": bool(params.stop),  # stop strings are matched on text
        "skip_special_tokens": False,
    }
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.seed is not None:
        sampling["seed"] = int(params.seed)
    if params.prompt_logprobs or params.prompt_top_logprobs:
        sampling["prompt_logprobs"] = int(params.prompt_top_logprobs)
    body: dict[str, Any] = {
        "token_ids": [int(t) for t in prompt],
        "sampling_params": sampling,
        "output_mode": "tokens",
    }
    if request_id is not None:
        body["request_id"] = str(request_id)
    return body


def generate_result(
    reply: Mapping[str, Any], prompt: list[int], params: SamplingParams, request_id: int | str
) -> GenerateResult:
    """One :class:`GenerateResult` from a reply to :func:`request_body`."""
    choices = reply.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise RuntimeError(f"vLLM reply: expected one choice, got {choices!r:.200}")
    choice = choices[0]
    output = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(output):
        raise RuntimeError(
            f"vLLM reply: {len(output)} tokens but {len(content)} log-probs (the request asks "
            "for logprobs; is the server vLLM >= 0.32?)"
        )
    for i, (token, entry) in enumerate(zip(output, content, strict=True)):
        if int(entry["token_id"]) != token:
            raise RuntimeError(
                f"vLLM reply: log-prob {i} is for id {entry['token_id']}, not {token}"
            )
    top = [_most_likely(e, params.top_logprobs) for e in content] if params.top_logprobs else None
    prompt_lp, prompt_top = _prompt_logprobs(reply.get("prompt_logprobs"), prompt, params)
    reason = _FINISH.get(str(choice.get("finish_reason")), "stop")
    return GenerateResult(
        request_id=request_id,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[float(e["logprob"]) for e in content],
        finish_reason=reason,
        sampling_mask=None,
        weight_version=weight_version(choice.get("weight_versions"), len(output)),
        prompt_logprobs=prompt_lp,
        prompt_top_logprobs=prompt_top,
        top_logprobs=top,
    )


def _most_likely(entry: Mapping[str, Any], n: int) -> list[tuple[int, float]]:
    """Ranks 1..``n`` of one position's kept distribution (the sampled token, listed first at
    its own rank, is among them only if it ranks so)."""
    ranked = {
        int(c["rank"]): (int(c["token_id"]), float(c["logprob"])) for c in entry["top_logprobs"]
    }
    return [ranked[r] for r in sorted(ranked) if r <= n]


def _prompt_logprobs(
    raw: Any, prompt: list[int], params: SamplingParams
) -> tuple[list[float] | None, list[list[tuple[int, float]] | None] | None]:
    """vLLM's per-position dicts (``None`` at 0; keyed by the id as text) as furlong's lists:
    the prompt token's raw log-prob (NaN at 0) and, if asked, the N most likely."""
    if not (params.prompt_logprobs or params.prompt_top_logprobs):
        return None, None
    if not isinstance(raw, list) or len(raw) != len(prompt):
        raise RuntimeError(
            f"vLLM reply: prompt_logprobs for {len(prompt)} tokens, got {raw!r:.200}"
        )
    values: list[float] = [float("nan")]
    tops: list[list[tuple[int, float]] | None] = [None]
    for position in range(1, len(prompt)):
        entries = {int(k): v for k, v in (raw[position] or {}).items()}
        token = prompt[position]
        if token not in entries:
            raise RuntimeError(f"vLLM reply: prompt_logprobs[{position}] lacks the prompt token")
        values.append(float(entries[token]["logprob"]))
        n = params.prompt_top_logprobs  # ranks 1..n; the prompt token rides along at its own
        ranked = sorted((int(e["rank"]), i, float(e["logprob"])) for i, e in entries.items())
        tops.append([(i, lp) for rank, i, lp in ranked if rank <= n])
    return (
        values if params.prompt_logprobs else None,
        tops if params.prompt_top_logprobs else None,
    )


def weight_version(spans: Any, tokens: int) -> int:
    """The integer version every output token was sampled under (vLLM labels versions as
    strings: furlong publishes integers). A request aborted before any token has no span and
    takes the version it was sent under (-1 when vLLM says none)."""
    if not spans:
        return -1
    versions = {str(s["version"]) for s in spans if int(s["end"]) > int(s["start"])}
    if len(versions) > 1:
        raise RuntimeError(
            f"vLLM reply: one request's {tokens} tokens came from weight versions "
            f"{sorted(versions)}; furlong never trains on a mixed rollout"
        )
    label = next(iter(versions)) if versions else str(spans[0]["version"])
    return int(label) if label.lstrip("-").isdigit() else -1

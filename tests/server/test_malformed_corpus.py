"""A corpus of malformed and hostile requests against a real ``furlong serve`` on 127.0.0.1.

Every case must be refused cleanly, and the contract is the same for all of them:

- HTTP 4xx whose JSON ``detail`` names the offending field, or HTTP 200 whose future resolves
  to ``{"error", "category": "user"}`` naming it (``Case.field``: any of the fragments);
- never a 5xx, never a hang (every HTTP call has a timeout; futures resolve within
  ``MAX_POLLS`` polls of ``POLL_TIMEOUT`` s);
- the victim training model is bitwise unchanged (parameters, ``.grad``, optimizer state);
  every victim has accumulated gradients and one optimizer step behind it, so the comparison
  is on nonzero values;
- the victim's next operation runs (``Case.then``): ``"next"`` - the refused request carried a
  valid model and ``seq_id``, so it consumes that ``seq_id`` and a forward-only at ``seq + 1``
  must succeed (a refusal that leaves a gap stalls the model until ``gap_timeout``);
  ``"same"`` - the request could not claim the victim's ``seq_id`` (bad ``seq_id``, another
  tenant, an unparsable body), so a forward-only at the victim's own next ``seq_id`` must
  succeed; ``"sample"`` - a valid ``asample`` still works.

Requests go as raw HTTP (JSON, or protobuf built with the SDK's codec and then corrupted) and,
for a few cases, through the official ``tinker`` SDK.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from furlong.server.app import create_app
from furlong.server.service import Service, ServiceConfig
from furlong.serving import background_server

os.environ.setdefault("TINKER_TELEMETRY", "0")
pytestmark = pytest.mark.usefixtures("one_thread")

BASE = "tiny-qwen3"
A_KEY, B_KEY = "tml-corpus-a", "tml-corpus-b"  # two tenants: A owns the victims
PROTOBUF = "application/x-protobuf"
HTTP_TIMEOUT = 60.0
POLL_TIMEOUT = 1.0  # the server holds a pending poll this long
GAP_TIMEOUT = 2.0  # a refusal that leaves a seq_id gap shows up as a gap error after this
MAX_POLLS = 30
BODY_LIMIT = 1 << 20
VOCAB = 768  # tiny-qwen3
CONTEXT = 2048  # tiny-qwen3 max_position_embeddings
NEXT_SEQ = 4  # a victim's next seq_id after its setup (fwdbwd 1, optim 2, fwdbwd 3)


class Hang(Exception):
    pass


# ---------------------------------------------------------------- raw HTTP client


class Wire:
    """Raw HTTP as one tenant (``key``); ``key=None`` sends no X-API-Key at all."""

    def __init__(self, url: str, key: str | None):
        headers = {} if key is None else {"X-API-Key": key}
        self.http = httpx.Client(base_url=url + "/api/v1", headers=headers, timeout=HTTP_TIMEOUT)

    def post(self, path: str, body: Any, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def raw(self, path: str, content: bytes, content_type="application/json", **headers):
        return self.http.post(
            path, content=content, headers={"Content-Type": content_type, **headers}
        )

    def proto(self, msg: pb.ForwardBackwardRequest | bytes, **headers) -> httpx.Response:
        body = msg if isinstance(msg, bytes) else msg.SerializeToString()
        return self.raw("/forward_backward", body, PROTOBUF, **headers)

    def session(self) -> str:
        req = tt.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="corpus")
        r = self.post("/create_session", req.model_dump(mode="json"))
        assert r.status_code == 200, r.text
        return r.json()["session_id"]

    def new_model(self, rank: int = 4, session: str | None = None, model_seq_id: int = 0) -> str:
        req = tt.CreateModelRequest(
            session_id=session or self.session(),
            model_seq_id=model_seq_id,
            base_model=BASE,
            lora_config=tt.LoraConfig(rank=rank, seed=7),
        )
        return self.ok(self.post("/create_model", req.model_dump(mode="json")))["model_id"]

    def poll(self, request_id: str) -> tuple[str, Any]:
        """``("proto", bytes)`` or ``("json", dict)``; raises :class:`Hang` past MAX_POLLS."""
        for _ in range(MAX_POLLS):
            r = self.post("/retrieve_future", {"request_id": request_id})
            if r.status_code != 200:
                return "http", r
            if r.headers.get("content-type", "").startswith(PROTOBUF):
                return "proto", r.content
            body = r.json()
            if not (isinstance(body, dict) and body.get("type") == "try_again"):
                return "json", body
        raise Hang(f"future {request_id} unresolved after {MAX_POLLS} polls")

    def ok(self, r: httpx.Response) -> Any:
        """The successful result of a submission (asserts on any failure)."""
        assert r.status_code == 200, r.text
        kind, out = self.poll(r.json()["request_id"])
        assert kind == "proto" or (kind == "json" and "error" not in out), out
        return out

    def optim(self, model_id: str, seq_id: int, lr: float = 1e-2) -> httpx.Response:
        body = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": lr}}
        return self.post("/optim_step", body)


# ---------------------------------------------------------------- valid requests to corrupt


def datums(seed: int = 0, n: int = 2, rl: bool = False) -> list[tt.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(3, 700, size=6 + 2 * i).tolist()
        t = len(tokens) - 1
        inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
        if rl:
            inputs["logprobs"] = (-rng.uniform(0.5, 3.0, size=t)).tolist()
            inputs["advantages"] = rng.normal(size=t).tolist()
        else:
            inputs["weights"] = [1.0] * t
        out.append(
            tt.Datum(model_input=tt.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
        )
    return out


def fb(
    model_id: str, seq_id: int, loss_fn: str = "cross_entropy", n: int = 2, seed: int = 0
) -> pb.ForwardBackwardRequest:
    """A valid ForwardBackwardRequest protobuf (``loss_fn`` cross_entropy or an RL loss)."""
    rl = loss_fn != "cross_entropy"
    req = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(
            data=datums(seed, n, rl),
            loss_fn=loss_fn,  # type: ignore[arg-type]
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req)


def forward_only(model_id: str, seq_id: int) -> pb.ForwardBackwardRequest:
    msg = fb(model_id, seq_id, seed=99)
    msg.forward_only = True
    return msg


def dense(t: pb.Tensor, values, dtype=np.float32, shape=None, wire_dtype=None) -> None:
    arr = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    t.dense = arr.tobytes()
    t.dtype = wire_dtype or {np.float32: pb.DTYPE_FLOAT32, np.int64: pb.DTYPE_INT64}[dtype]
    t.shape[:] = list(arr.shape) if shape is None else shape


def csr(t: pb.Tensor, values, crow, col, shape, dtype=np.int64) -> None:
    t.sparse_csr.values = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
    t.sparse_csr.crow_indices = np.asarray(crow, dtype="<i8").tobytes()
    t.sparse_csr.col_indices = np.asarray(col, dtype="<i8").tobytes()
    t.dtype = pb.DTYPE_INT64 if dtype == np.int64 else pb.DTYPE_FLOAT32
    t.shape[:] = shape


def n_targets(msg: pb.ForwardBackwardRequest, i: int) -> int:
    return len(msg.data[i].loss_fn_inputs["target_tokens"].dense) // 8


def config(msg: pb.ForwardBackwardRequest, key: str, value: float | str) -> None:
    """Set a loss_fn_config key the way the SDK does (numbers in both maps, text in v2)."""
    if isinstance(value, str):
        msg.loss_fn_config_v2[key].text = value
    else:
        msg.loss_fn_config[key] = value
        msg.loss_fn_config_v2[key].number = value


# ---------------------------------------------------------------- victim state


def state_of(service: Service, model_id: str) -> dict[str, Any]:
    engine = service.pool.get(model_id).engine
    opt = engine.optimizer.state_dict()
    return {
        "params": {
            n: p.detach().clone() for n, p in zip(engine.param_names, engine.params, strict=True)
        },
        "grads": {
            n: None if p.grad is None else p.grad.detach().clone()
            for n, p in zip(engine.param_names, engine.params, strict=True)
        },
        "optimizer": _clone(opt),
        "step": getattr(engine, "step", None),
    }


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_clone(v) for v in x)
    return x


def differences(before: Any, after: Any, where: str = "") -> list[str]:
    if isinstance(before, torch.Tensor) or isinstance(after, torch.Tensor):
        same = (
            isinstance(before, torch.Tensor)
            and isinstance(after, torch.Tensor)
            and before.shape == after.shape
            and before.dtype == after.dtype
            and torch.equal(before, after)
        )
        return [] if same else [where]
    if isinstance(before, dict) and isinstance(after, dict):
        if set(before) != set(after):
            return [f"{where} keys"]
        return [d for k in before for d in differences(before[k], after[k], f"{where}.{k}")]
    if isinstance(before, list | tuple) and isinstance(after, list | tuple):
        if len(before) != len(after):
            return [f"{where} length"]
        return [
            d
            for i, (a, b) in enumerate(zip(before, after, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    return [] if before == after else [f"{where}: {before!r} -> {after!r}"]


def assert_nonzero_history(state: dict[str, Any]) -> None:
    assert any(g is not None and bool(g.abs().sum() > 0) for g in state["grads"].values())
    assert state["optimizer"]["state"], "the victim has no optimizer state"


# ---------------------------------------------------------------- the module's server


@dataclass
class Env:
    url: str
    service: Service
    a: Wire
    b: Wire
    nokey: Wire
    badkey: Wire
    a_session: str
    b_session: str
    bystander: str  # A's model every non-victim case must leave unchanged
    a_sampler: str
    b_sampler: str
    a_donor: str
    a_weights: str
    a_sampler_path: str
    a_rank8_weights: str
    b_model: str
    b_weights: str
    b_sampler_path: str
    spare: list[tuple[str, int]] = field(default_factory=list)

    def victim(self) -> tuple[str, int]:
        """``(model, next seq_id)``: a model of tenant A with accumulated gradients after one
        optimizer step; a victim that came through a case unharmed is used again."""
        if self.spare:
            return self.spare.pop()
        model = self.a.new_model()
        self.a.ok(self.a.proto(fb(model, 1, seed=1)))
        self.a.ok(self.a.optim(model, 2))
        self.a.ok(self.a.proto(fb(model, 3, seed=2)))
        return model, NEXT_SEQ


@pytest.fixture(scope="module")
def env(tmp_path_factory, one_thread):
    config = ServiceConfig(
        base_models={BASE: BASE},
        state_dir=tmp_path_factory.mktemp("corpus") / "state",
        gap_timeout=GAP_TIMEOUT,
        poll_timeout=POLL_TIMEOUT,
        compress_fwdbwd=True,  # zstd bodies accepted (and bombs possible)
        max_models_per_key=0,  # the corpus makes a model per case on one key
    )
    service = Service(config)
    with background_server(create_app(service, max_body_bytes=BODY_LIMIT)) as url:
        a, b = Wire(url, A_KEY), Wire(url, B_KEY)
        a_session, b_session = a.session(), b.session()

        def sampler(w: Wire, session: str, **where) -> str:
            body = {"session_id": session, "sampling_session_seq_id": 0, **where}
            r = w.post("/create_sampling_session", body)
            assert r.status_code == 200, r.text
            return r.json()["sampling_session_id"]

        def save(w: Wire, model: str, seq: int, route: str, name: str) -> str:
            body = {"model_id": model, "seq_id": seq, "path": name}
            return w.ok(w.post(route, body))["path"]

        donor = a.new_model()
        a_weights = save(a, donor, 1, "/save_weights", "w1")
        a_sampler_path = save(a, donor, 2, "/save_weights_for_sampler", "s1")
        rank8 = a.new_model(rank=8)
        a_rank8 = save(a, rank8, 1, "/save_weights", "r8")
        b_model = b.new_model()
        b_weights = save(b, b_model, 1, "/save_weights", "bw")
        b_sampler_path = save(b, b_model, 2, "/save_weights_for_sampler", "bs")
        env = Env(
            url=url,
            service=service,
            a=a,
            b=b,
            nokey=Wire(url, None),
            badkey=Wire(url, "not-a-tinker-key"),
            a_session=a_session,
            b_session=b_session,
            bystander="",
            a_sampler=sampler(a, a_session, base_model=BASE),
            b_sampler=sampler(b, b_session, base_model=BASE),
            a_donor=donor,
            a_weights=a_weights,
            a_sampler_path=a_sampler_path,
            a_rank8_weights=a_rank8,
            b_model=b_model,
            b_weights=b_weights,
            b_sampler_path=b_sampler_path,
        )
        env.bystander = env.victim()[0]
        yield env


# ---------------------------------------------------------------- the contract


@dataclass(frozen=True)
class Ctx:
    env: Env
    model: str  # the victim (tenant A)
    seq: int  # the victim's next seq_id


@dataclass(frozen=True)
class Case:
    id: str
    send: Callable[[Ctx], httpx.Response]
    field: str | tuple[str, ...]  # the response must name one of these
    then: str = "none"  # "next" | "same" | "sample" | "none" (see the module docstring)
    status: tuple[int, ...] | None = None  # required HTTP status (no future path) if given
    direct: bool = False  # retrieve_future itself: a 200 error body is the answer

    @property
    def victim(self) -> bool:
        return self.then in ("next", "same")


def names(text: str, field: str | tuple[str, ...]) -> bool:
    # "datum 1: loss_fn_inputs['w']" (engine validation) names the same thing as
    # "data[1].loss_fn_inputs['w']" (protobuf decoding)
    text = re.sub(r"datum (\d+): ", r"data[\1].", text)
    fields = (field,) if isinstance(field, str) else field
    return any(f in text for f in fields)


def excerpt(x: Any, n: int = 220) -> str:
    s = x if isinstance(x, str) else json.dumps(x) if not isinstance(x, bytes) else repr(x[:60])
    return s if len(s) <= n else s[:n] + "..."


def judge(case: Case, env: Env, r: httpx.Response) -> list[str]:
    """Problems with the answer to a refused request (empty: it met the contract)."""
    code = r.status_code
    if code >= 500:
        return [f"HTTP {code}: {excerpt(r.text)}"]
    if case.status is not None and code not in case.status:
        return [f"HTTP {code} (want {case.status}): {excerpt(r.text)}"]
    try:
        body = r.json()
    except ValueError:
        return [f"HTTP {code} without a JSON body: {excerpt(r.text)}"]
    if 400 <= code < 500:
        detail = body.get("detail") if isinstance(body, dict) else None
        if detail is None:
            return [f"HTTP {code} without 'detail': {excerpt(body)}"]
        text = detail if isinstance(detail, str) else json.dumps(detail)
        if not names(text, case.field):
            return [f"HTTP {code} does not name {case.field!r}: {excerpt(text)}"]
        return []
    if code != 200:
        return [f"HTTP {code}: {excerpt(r.text)}"]
    if case.direct:  # retrieve_future answers for itself
        return _judge_failure(case, body)
    if not isinstance(body, dict) or "request_id" not in body:
        return [f"HTTP 200 without a request_id: {excerpt(body)}"]
    sender = {B_KEY: env.b}.get(r.request.headers.get("x-api-key", ""), env.a)
    try:
        kind, out = sender.poll(body["request_id"])
    except Hang as e:
        return [f"accepted (200), then hang: {e}"]
    if kind == "http":
        return [f"accepted (200), then retrieve_future HTTP {out.status_code}: {excerpt(out.text)}"]
    if kind == "proto":
        return ["accepted (200) and SUCCEEDED (protobuf result)"]
    return _judge_failure(case, out)


def _judge_failure(case: Case, out: Any) -> list[str]:
    if not isinstance(out, dict) or "error" not in out:
        return [f"accepted (200) and SUCCEEDED: {excerpt(out)}"]
    problems = []
    if out.get("category") != "user":
        problems.append(f"future error category {out.get('category')!r}: {excerpt(out['error'])}")
    elif not names(str(out["error"]), case.field):
        problems.append(f"future error does not name {case.field!r}: {excerpt(out['error'])}")
    return problems


def follow_up(case: Case, ctx: Ctx) -> list[str]:
    env = ctx.env
    if case.then == "sample":
        body = sample_body(env.a_sampler, max_tokens=2)
        try:
            r = env.a.post("/asample", body)
            if r.status_code != 200:
                return [f"follow-up asample HTTP {r.status_code}: {excerpt(r.text)}"]
            kind, out = env.a.poll(r.json()["request_id"])
        except (Hang, httpx.TimeoutException) as e:
            return [f"follow-up asample hangs: {e}"]
        return [] if kind == "proto" else [f"follow-up asample failed: {excerpt(out)}"]
    if case.then not in ("next", "same"):
        return []
    seq = ctx.seq + 1 if case.then == "next" else ctx.seq
    try:
        r = env.a.proto(forward_only(ctx.model, seq))
        if r.status_code != 200:
            return [f"follow-up forward_only(seq {seq}) HTTP {r.status_code}: {excerpt(r.text)}"]
        kind, out = env.a.poll(r.json()["request_id"])
    except (Hang, httpx.TimeoutException) as e:
        return [f"follow-up forward_only(seq {seq}) hangs: {e}"]
    if kind == "proto":
        return []
    gap = "never arrived" in str(out) or "gap" in str(out)
    what = "SEQ GAP" if gap else "failed"
    return [f"follow-up forward_only(seq {seq}) {what}: {excerpt(out)}"]


def run_case(case: Case, env: Env) -> None:
    model, seq = env.victim() if case.victim else (env.bystander, 0)
    ctx = Ctx(env, model, seq)
    before = state_of(env.service, model)
    assert_nonzero_history(before)
    try:
        r = case.send(ctx)
        print(f"{case.id}: HTTP {r.status_code} {excerpt(r.text, 160)}")  # shown with -s
        problems = judge(case, env, r)
    except httpx.TimeoutException as e:
        problems = [f"submission hangs: {type(e).__name__}"]
    problems += follow_up(case, ctx)
    changed = differences(before, state_of(env.service, model))
    if changed:
        problems.append(f"victim state changed: {changed[:4]}{' ...' if len(changed) > 4 else ''}")
    if case.victim and not problems:  # unharmed, and its next seq_id is known
        env.spare.append((model, seq + 2 if case.then == "next" else seq + 1))
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- forward_backward cases


def fb_case(id, mutate, field, then="next", loss_fn="cross_entropy", status=None) -> Case:
    """A forward_backward from tenant A on the victim at its next seq_id, then ``mutate``d."""

    def send(ctx: Ctx) -> httpx.Response:
        msg = fb(ctx.model, ctx.seq, loss_fn)
        out = mutate(msg, ctx)  # bytes: send these instead of the message
        return ctx.env.a.proto(out if isinstance(out, bytes) else msg)

    return Case(id, send, field, then, status)


W1 = "data[1].loss_fn_inputs['weights']"
T1 = "data[1].loss_fn_inputs['target_tokens']"
T0 = "data[0].loss_fn_inputs['target_tokens']"
LP1 = "data[1].loss_fn_inputs['logprobs']"
ADV1 = "data[1].loss_fn_inputs['advantages']"
MI1 = "data[1].model_input"


def _set(attr, value):
    return lambda m, c: setattr(m, attr, value)


def _cfg(key, value):
    return lambda m, c: config(m, key, value)


def _tgt(values_fn, i=1, dtype=np.int64, wire_dtype=None):
    def mutate(m, c):
        n = n_targets(m, i)
        dense(m.data[i].loss_fn_inputs["target_tokens"], values_fn(n), dtype, wire_dtype=wire_dtype)

    return mutate


def _inp(key, values_fn, i=1, dtype=np.float32, shape=None, wire_dtype=None):
    def mutate(m, c):
        n = n_targets(m, i)
        dense(m.data[i].loss_fn_inputs[key], values_fn(n), dtype, shape, wire_dtype)

    return mutate


def _del(key, i=1):
    return lambda m, c: m.data[i].loss_fn_inputs.pop(key)


def _tokens(values, i=1):
    def mutate(m, c):
        del m.data[i].model_input[:]
        m.data[i].model_input.add().encoded_text.tokens = np.asarray(values, "<i4").tobytes()
        # keep the per-token inputs consistent, so only model_input is wrong
        n = len(values)
        for key in list(m.data[i].loss_fn_inputs):
            if key == "target_tokens":
                dense(m.data[i].loss_fn_inputs[key], [5] * n, np.int64)
            else:
                dense(m.data[i].loss_fn_inputs[key], [1.0] * n)

    return mutate


def _raw_bytes(body_fn):
    return lambda m, c: body_fn(m.SerializeToString())


def _sparse_nan_weights(m, c) -> None:
    """Datum 1 in the 2-D form (n, 1): dense targets, CSR weights holding a NaN."""
    n = n_targets(m, 1)
    dense(m.data[1].loss_fn_inputs["target_tokens"], [[5]] * n, np.int64)
    csr(
        m.data[1].loss_fn_inputs["weights"],
        [nan] + [1.0] * (n - 1),
        range(n + 1),
        [0] * n,
        [n, 1],
        np.float32,
    )


def _zstd_bomb_valid(m: pb.ForwardBackwardRequest, c) -> bytes:
    """A valid request whose extra input inflates the body to 64 MiB (the limit is 1 MiB)."""
    junk = m.data[0].loss_fn_inputs["junk"]
    dense(junk, np.zeros(16 << 20, np.float32))
    return zstandard.ZstdCompressor(level=19).compress(m.SerializeToString())


def _image(m, c):
    chunk = m.data[1].model_input.add()
    chunk.image.data = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
    chunk.image.format = "png"


def _empty_chunk(m, c):
    m.data[1].model_input.add()  # no oneof set


def _other_tenant_send(ctx: Ctx) -> httpx.Response:
    return ctx.env.b.proto(fb(ctx.model, ctx.seq))  # B names A's model and A's next seq_id


def _dup_send(used_seq: int | None):
    """A different body on a seq_id already taken (``used_seq`` None: take the victim's next
    seq_id first with a harmless forward-only)."""

    def send(ctx: Ctx) -> httpx.Response:
        seq = used_seq
        if seq is None:
            seq = ctx.seq
            ctx.env.a.ok(ctx.env.a.proto(forward_only(ctx.model, seq)))
        return ctx.env.a.proto(fb(ctx.model, seq, seed=123))

    return send


def _seq(value):
    def mutate(m, c):
        m.seq_id = value

    return mutate


nan, inf = math.nan, math.inf

FORWARD_BACKWARD: list[Case] = [
    # loss_fn
    fb_case("fb-loss_fn-unknown", _set("loss_fn", "nope"), "loss_fn"),
    fb_case("fb-loss_fn-empty", _set("loss_fn", ""), "loss_fn"),
    fb_case("fb-loss_fn-custom", _set("loss_fn", "custom"), "loss_fn"),
    fb_case("fb-loss_fn-gspo", _set("loss_fn", "gspo"), "loss_fn"),
    fb_case("fb-loss_fn-nul-bytes", _set("loss_fn", "cross_entropy\0"), "loss_fn"),
    # loss_fn_config
    fb_case(
        "fb-config-ppo-clip_low-nan",
        _cfg("clip_low_threshold", nan),
        "clip_low_threshold",
        loss_fn="ppo",
    ),
    fb_case(
        "fb-config-ppo-clip_high-inf",
        _cfg("clip_high_threshold", inf),
        "clip_high_threshold",
        loss_fn="ppo",
    ),
    fb_case(
        "fb-config-ppo-clip_low-negative",
        _cfg("clip_low_threshold", -0.5),
        "clip_low_threshold",
        loss_fn="ppo",
    ),
    fb_case(
        "fb-config-ppo-low-above-high",
        lambda m, c: (config(m, "clip_low_threshold", 2.0), config(m, "clip_high_threshold", 1.0)),
        "clip_low_threshold",
        loss_fn="ppo",
    ),
    fb_case(
        "fb-config-cispo-text-value",
        _cfg("clip_high_threshold", "four"),
        "clip_high_threshold",
        loss_fn="cispo",
    ),
    fb_case("fb-config-dro-beta-negative", _cfg("beta", -1.0), "beta", loss_fn="dro"),
    fb_case("fb-config-dro-beta-nan", _cfg("beta", nan), "beta", loss_fn="dro"),
    fb_case(
        "fb-config-v2-value-unset",
        lambda m, c: m.loss_fn_config_v2["beta"].SetInParent(),
        "beta",
        loss_fn="dro",
    ),
    fb_case(
        "fb-config-legacy-map-inf",
        lambda m, c: m.loss_fn_config.__setitem__("beta", inf),
        "beta",
        loss_fn="dro",
    ),
    # target_tokens
    fb_case("fb-target-missing", _del("target_tokens"), T1),
    fb_case("fb-target-short", _tgt(lambda n: [5] * (n - 1)), T1),
    fb_case("fb-target-long", _tgt(lambda n: [5] * (n + 3)), T1),
    fb_case("fb-target-empty", _tgt(lambda n: []), T1),
    fb_case("fb-target-negative", _tgt(lambda n: [5] * (n - 1) + [-3]), T1),
    fb_case("fb-target-out-of-vocab", _tgt(lambda n: [5] * (n - 1) + [VOCAB]), T1),
    fb_case("fb-target-huge-id", _tgt(lambda n: [2**62] * n), T1),
    fb_case("fb-target-float-nan", _tgt(lambda n: [nan] * n, dtype=np.float32), T1),
    fb_case("fb-target-float-inf", _tgt(lambda n: [inf] * n, dtype=np.float32), T1),
    fb_case("fb-target-float-integral", _tgt(lambda n: [5.0] * n, dtype=np.float32), T1),
    fb_case(
        "fb-target-2d-for-ppo",
        _inp("target_tokens", lambda n: [[5]] * n, dtype=np.int64),
        T1,
        loss_fn="ppo",
    ),
    # weights
    fb_case("fb-weights-short", _inp("weights", lambda n: [1.0] * (n - 1)), W1),
    fb_case("fb-weights-long", _inp("weights", lambda n: [1.0] * (n + 1)), W1),
    fb_case("fb-weights-nan", _inp("weights", lambda n: [1.0] * (n - 1) + [nan]), W1),
    fb_case("fb-weights-inf", _inp("weights", lambda n: [-inf] + [1.0] * (n - 1)), W1),
    fb_case("fb-weights-dtype-unknown", _inp("weights", lambda n: [1.0] * n, wire_dtype=99), W1),
    fb_case(
        "fb-weights-dtype-unset",
        lambda m, c: m.data[1].loss_fn_inputs["weights"].ClearField("dtype"),
        W1,
    ),
    fb_case(
        "fb-weights-bytes-not-multiple",
        lambda m, c: setattr(m.data[1].loss_fn_inputs["weights"], "dense", b"\0" * 5),
        W1,
    ),
    fb_case(
        "fb-weights-shape-disagrees-with-bytes",
        lambda m, c: m.data[1].loss_fn_inputs["weights"].shape.__setitem__(0, n_targets(m, 1) + 7),
        W1,
    ),
    fb_case(
        "fb-weights-negative-dim",
        lambda m, c: m.data[1].loss_fn_inputs["weights"].shape.__setitem__(0, -1),
        W1,
    ),
    fb_case("fb-weights-2d-for-1d-targets", _inp("weights", lambda n: [[1.0]] * n), W1),
    fb_case("fb-weights-sparse-nan", _sparse_nan_weights, W1),
    # logprobs / advantages (RL losses)
    fb_case("fb-logprobs-missing", _del("logprobs"), LP1, loss_fn="importance_sampling"),
    fb_case(
        "fb-logprobs-nan", _inp("logprobs", lambda n: [nan] * n), LP1, loss_fn="importance_sampling"
    ),
    fb_case("fb-logprobs-pos-inf", _inp("logprobs", lambda n: [inf] * n), LP1, loss_fn="ppo"),
    fb_case("fb-logprobs-short", _inp("logprobs", lambda n: [-1.0] * (n - 2)), LP1, loss_fn="ppo"),
    fb_case(
        "fb-logprobs-int64-dtype-bytes",
        _inp("logprobs", lambda n: [-1.0] * n, wire_dtype=pb.DTYPE_INT64),
        LP1,
        loss_fn="ppo",
    ),
    fb_case("fb-advantages-missing", _del("advantages"), ADV1, loss_fn="ppo"),
    fb_case("fb-advantages-nan", _inp("advantages", lambda n: [nan] * n), ADV1, loss_fn="cispo"),
    fb_case("fb-advantages-inf", _inp("advantages", lambda n: [inf] * n), ADV1, loss_fn="dro"),
    fb_case(
        "fb-advantages-2d",
        _inp("advantages", lambda n: [[1.0, 2.0]] * n),
        ADV1,
        loss_fn="importance_sampling",
    ),
    # sparse CSR (2-D cross_entropy form); weights are dense (n, 2)
    fb_case(
        "fb-sparse-crow-decreasing",
        lambda m, c: _csr0(m, crow_fn=lambda n: [0, 2, 1] + [2] * (n - 2)),
        T0,
    ),
    fb_case("fb-sparse-crow-wrong-length", lambda m, c: _csr0(m, crow_fn=lambda n: [0, 2]), T0),
    fb_case(
        "fb-sparse-crow-last-not-nnz",
        lambda m, c: _csr0(m, crow_fn=lambda n: list(range(0, 2 * n + 1, 2))[:-1] + [2 * n + 5]),
        T0,
    ),
    fb_case(
        "fb-sparse-crow-first-not-zero",
        lambda m, c: _csr0(m, crow_fn=lambda n: [1] + list(range(2, 2 * n + 1, 2))),
        T0,
    ),
    fb_case("fb-sparse-col-out-of-range", lambda m, c: _csr0(m, col_fn=lambda n: [0, 2] * n), T0),
    fb_case("fb-sparse-col-negative", lambda m, c: _csr0(m, col_fn=lambda n: [-1, 1] * n), T0),
    fb_case(
        "fb-sparse-col-repeated-in-row", lambda m, c: _csr0(m, col_fn=lambda n: [1, 1] * n), T0
    ),
    fb_case("fb-sparse-1d-shape", lambda m, c: _csr0(m, shape_fn=lambda n: [2 * n]), T0),
    fb_case("fb-sparse-no-shape", lambda m, c: _csr0(m, shape_fn=lambda n: []), T0),
    fb_case(
        "fb-sparse-huge-dense-shape-2GiB",
        lambda m, c: _csr0(m, shape_fn=lambda n: [n, 1 << 28]),
        T0,
    ),
    fb_case(
        "fb-sparse-huge-rows",
        lambda m, c: csr(
            m.data[0].loss_fn_inputs["target_tokens"],
            [5],
            [0, 1] + [1] * ((1 << 16) - 1),
            [0],
            [1 << 16, 1 << 12],
        ),
        T0,
    ),
    # data / model_input
    fb_case("fb-data-empty", lambda m, c: m.ClearField("data"), "data"),
    fb_case(
        "fb-model_input-no-chunks",
        lambda m, c: (m.data[1].ClearField("model_input"), _strip_inputs(m, 1)),
        MI1,
    ),
    fb_case("fb-model_input-empty-tokens", _tokens([]), MI1),
    fb_case(
        "fb-model_input-bytes-not-multiple",
        lambda m, c: setattr(m.data[1].model_input[0].encoded_text, "tokens", b"\1\0\0"),
        MI1,
    ),
    fb_case("fb-model_input-out-of-vocab", _tokens([5, 6, VOCAB + 5]), MI1),
    fb_case("fb-model_input-negative", _tokens([5, -6, 7]), MI1),
    fb_case(
        "fb-model_input-longer-than-context",
        _tokens([int(t) for t in np.arange(CONTEXT + 60) % 700 + 3]),
        MI1,
    ),
    fb_case("fb-model_input-image-chunk", _image, MI1),
    fb_case("fb-model_input-unset-chunk", _empty_chunk, MI1),
    fb_case(
        "fb-forward_only-nan-weights",
        lambda m, c: (setattr(m, "forward_only", True), _inp("weights", lambda n: [nan] * n)(m, c)),
        W1,
    ),
    # model_id
    fb_case(
        "fb-model_id-unknown",
        _set("model_id", "s000000000000:train:0"),
        ("model_id", "s000000000000:train:0"),
        then="same",
        status=(400, 404),
    ),
    fb_case(
        "fb-model_id-empty",
        _set("model_id", ""),
        ("model_id", "model ''"),
        then="same",
        status=(400, 404),
    ),
    Case("fb-model_id-other-tenant", _other_tenant_send, ("model_id", "model '"), "same", (404,)),
    # seq_id
    fb_case("fb-seq_id-zero", _seq(0), "seq_id", then="same"),
    fb_case("fb-seq_id-negative", _seq(-5), "seq_id", then="same"),
    fb_case("fb-seq_id-far-future", _seq(10**9), "seq_id", then="same"),
    fb_case("fb-seq_id-int32-max", _seq(2**31 - 1), "seq_id", then="same"),
    Case("fb-seq_id-reused-different-body", _dup_send(3), "seq_id", "same", (409,)),
    Case("fb-seq_id-duplicate-different-body", _dup_send(None), "seq_id", "next", (409,)),
    # bodies and encodings
    fb_case(
        "fb-body-garbage", lambda m, c: b"\xff\xfe\x00garbage\x13\x37" * 40, "body", then="same"
    ),
    fb_case("fb-body-truncated", lambda m, c: m.SerializeToString()[:-7], "body", then="same"),
    fb_case(
        "fb-body-empty", lambda m, c: b"", ("body", "data", "model_id", "model ''"), then="same"
    ),
    fb_case(
        "fb-body-json",
        lambda m, c: json.dumps({"model_id": c.model, "seq_id": c.seq}).encode(),
        ("body", "Content-Type"),
        then="same",
    ),
    Case(
        "fb-zstd-bomb-valid-request",
        lambda c: c.env.a.proto(
            _zstd_bomb_valid(fb(c.model, c.seq), c), **{"Content-Encoding": "zstd"}
        ),
        "body",
        "same",
        (413, 400),
    ),
    Case(
        "fb-zstd-bomb-zeros",
        lambda c: c.env.a.proto(
            zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20)),
            **{"Content-Encoding": "zstd"},
        ),
        "body",
        "same",
        (413, 400),
    ),
    Case(
        "fb-zstd-corrupt",
        lambda c: c.env.a.proto(b"\x28\xb5\x2f\xfd" + b"\x99" * 64, **{"Content-Encoding": "zstd"}),
        "body",
        "same",
    ),
    Case(
        "fb-zstd-truncated",
        lambda c: c.env.a.proto(
            zstandard.ZstdCompressor().compress(fb(c.model, c.seq).SerializeToString())[:-9],
            **{"Content-Encoding": "zstd"},
        ),
        "body",
        "same",
    ),
    Case(
        "fb-zstd-header-on-plain-body",
        lambda c: c.env.a.proto(fb(c.model, c.seq), **{"Content-Encoding": "zstd"}),
        "body",
        "same",
    ),
    Case(
        "fb-content-encoding-gzip",
        lambda c: c.env.a.proto(fb(c.model, c.seq), **{"Content-Encoding": "gzip"}),
        "Content-Encoding",
        "same",
    ),
    Case(
        "fb-content-encoding-unknown",
        lambda c: c.env.a.proto(fb(c.model, c.seq), **{"Content-Encoding": "x-furlong-nope"}),
        "Content-Encoding",
        "same",
    ),
    Case(
        "fb-body-over-limit",
        lambda c: c.env.a.proto(fb(c.model, c.seq).SerializeToString() + b"\0" * BODY_LIMIT),
        "body",
        "same",
        (413,),
    ),
]


def _strip_inputs(m: pb.ForwardBackwardRequest, i: int) -> None:
    for key in list(m.data[i].loss_fn_inputs):
        dense(m.data[i].loss_fn_inputs[key], [], np.int64 if key == "target_tokens" else np.float32)


def _csr0(m, crow_fn=None, col_fn=None, shape_fn=None) -> None:
    """Datum 0 in the 2-D top-K form (n, 2): CSR targets (one of its arrays corrupted)."""
    n = n_targets(m, 0)
    crow = crow_fn(n) if crow_fn else list(range(0, 2 * n + 1, 2))
    col = col_fn(n) if col_fn else [0, 1] * n
    shape = shape_fn(n) if shape_fn else [n, 2]
    csr(m.data[0].loss_fn_inputs["target_tokens"], [5, 6] * n, crow, col, shape)
    dense(m.data[0].loss_fn_inputs["weights"], [[1.0, 0.5]] * n)


# ---------------------------------------------------------------- optim_step cases


def optim_case(id, adam=None, field="", then="next", status=None, **overrides) -> Case:
    """An optim_step from tenant A on the victim at its next seq_id."""

    def send(ctx: Ctx) -> httpx.Response:
        body: dict[str, Any] = {"model_id": ctx.model, "seq_id": ctx.seq, "type": "optim_step"}
        body["adam_params"] = {"learning_rate": 1e-3, **(adam or {})}
        for key, value in overrides.items():
            if value is _DROP:
                body.pop(key)
            else:
                body[key] = value(ctx) if callable(value) else value
        return ctx.env.a.raw("/optim_step", _dumps(body))

    return Case(id, send, field, then, status)


_DROP = object()


def _dumps(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN / Infinity literals, as Python sends


OPTIM_STEP: list[Case] = [
    optim_case("optim-lr-negative", {"learning_rate": -1e-3}, "learning_rate"),
    optim_case("optim-lr-nan", {"learning_rate": nan}, "learning_rate"),
    optim_case("optim-lr-inf", {"learning_rate": inf}, "learning_rate"),
    optim_case("optim-lr-string", {"learning_rate": "fast"}, "learning_rate"),
    optim_case("optim-lr-null", {"learning_rate": None}, "learning_rate"),
    optim_case("optim-lr-object", {"learning_rate": {"value": 1}}, "learning_rate"),
    optim_case("optim-beta1-one", {"beta1": 1.0}, "beta1"),
    optim_case("optim-beta1-negative", {"beta1": -0.1}, "beta1"),
    optim_case("optim-beta2-nan", {"beta2": nan}, "beta2"),
    optim_case("optim-beta2-above-one", {"beta2": 1.5}, "beta2"),
    optim_case("optim-eps-negative", {"eps": -1e-8}, "eps"),
    optim_case("optim-eps-inf", {"eps": inf}, "eps"),
    optim_case("optim-weight_decay-negative", {"weight_decay": -0.1}, "weight_decay"),
    optim_case("optim-weight_decay-nan", {"weight_decay": nan}, "weight_decay"),
    optim_case("optim-grad_clip_norm-nan", {"grad_clip_norm": nan}, "grad_clip_norm"),
    optim_case("optim-grad_clip_norm-negative", {"grad_clip_norm": -1.0}, "grad_clip_norm"),
    optim_case("optim-adam-unknown-key", {"momentum": 0.9}, "momentum"),
    optim_case(
        "optim-params-unknown-type",
        field="type",
        adam_params=_DROP,
        optimizer_params={"type": "sgd", "learning_rate": 0.1},
    ),
    optim_case(
        "optim-params-dimuon-on-adamw",
        field=("type", "dimuon"),
        adam_params=_DROP,
        optimizer_params={"type": "dimuon", "learning_rate": 0.1},
    ),
    optim_case("optim-params-missing", field=("adam_params", "optim_params"), adam_params=_DROP),
    optim_case("optim-params-list", field=("adam_params", "optim_params"), adam_params=[1e-3]),
    optim_case("optim-unknown-top-level-key", field="surprise", surprise=1),
    optim_case("optim-seq_id-zero", field="seq_id", then="same", seq_id=0),
    optim_case("optim-seq_id-negative", field="seq_id", then="same", seq_id=-1),
    optim_case("optim-seq_id-far-future", field="seq_id", then="same", seq_id=10**9),
    optim_case("optim-seq_id-2**64", field="seq_id", then="same", seq_id=2**64),
    optim_case("optim-seq_id-string", field="seq_id", then="same", seq_id="four"),
    optim_case("optim-seq_id-float", field="seq_id", then="same", seq_id=4.5),
    optim_case("optim-seq_id-missing", field="seq_id", then="same", seq_id=_DROP),
    optim_case("optim-seq_id-reused", field="seq_id", then="same", status=(409,), seq_id=3),
    optim_case(
        "optim-model_id-unknown",
        field=("model_id", "nobody:train:0"),
        then="same",
        status=(400, 404),
        model_id="nobody:train:0",
    ),
    optim_case(
        "optim-model_id-other-tenant",
        field=("model_id", "model '"),
        then="same",
        status=(404,),
        model_id=lambda c: c.env.b_model,
    ),
    optim_case("optim-model_id-int", field="model_id", then="same", model_id=12),
]


# ---------------------------------------------------------------- checkpoint cases


def save_case(route, id, field, then="next", status=None, **overrides) -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        body: dict[str, Any] = {"model_id": ctx.model, "seq_id": ctx.seq, "path": "ok-name"}
        for key, value in overrides.items():
            if value is _DROP:
                body.pop(key)
            else:
                body[key] = value(ctx) if callable(value) else value
        return ctx.env.a.raw(route, _dumps(body))

    return Case(id, send, field, then, status)


def load_case(id, field, then="next", status=None, **overrides) -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        body: dict[str, Any] = {
            "model_id": ctx.model,
            "seq_id": ctx.seq,
            "path": ctx.env.a_weights,
            "optimizer": True,
        }
        for key, value in overrides.items():
            if value is _DROP:
                body.pop(key)
            else:
                body[key] = value(ctx) if callable(value) else value
        return ctx.env.a.raw("/load_weights", _dumps(body))

    return Case(id, send, field, then, status)


SW, SWS = "/save_weights", "/save_weights_for_sampler"

CHECKPOINTS: list[Case] = [
    save_case(SW, "save-path-slash", "path", path="a/b"),
    save_case(SW, "save-path-dotdot", "path", path=".."),
    save_case(SW, "save-path-traversal", "path", path="../../../../tmp/evil"),
    save_case(SW, "save-path-too-long", "path", path="x" * 300),
    save_case(SW, "save-path-empty", "path", path=""),
    save_case(SW, "save-path-nul", "path", path="bad\0name"),
    save_case(SW, "save-path-tinker-uri", "path", path="tinker://x/weights/y"),
    save_case(SW, "save-path-leading-dot", "path", path=".hidden"),
    save_case(SW, "save-path-int", "path", path=123),
    save_case(SW, "save-ttl-string", "ttl_seconds", ttl_seconds="forever"),
    save_case(SW, "save-seq_id-zero", "seq_id", then="same", seq_id=0),
    save_case(SW, "save-seq_id-far-future", "seq_id", then="same", seq_id=10**9),
    save_case(
        SW,
        "save-model_id-other-tenant",
        ("model_id", "model '"),
        then="same",
        status=(404,),
        model_id=lambda c: c.env.b_model,
    ),
    save_case(SWS, "save_sampler-path-slash", "path", path="a/b"),
    save_case(SWS, "save_sampler-path-traversal", "path", path="../x"),
    save_case(SWS, "save_sampler-path-too-long", "path", path="y" * 201),
    save_case(SWS, "save_sampler-no-path-no-session", "path", path=_DROP),
    save_case(SWS, "save_sampler-kind-bogus", "kind", kind="bogus"),
    save_case(
        SWS,
        "save_sampler-session-seq-string",
        "sampling_session_seq_id",
        path=_DROP,
        sampling_session_seq_id="x",
    ),
    save_case(SWS, "save_sampler-seq_id-negative", "seq_id", then="same", seq_id=-3),
    load_case("load-path-not-tinker", "path", path="/etc/passwd"),
    load_case("load-path-scheme-only", "path", path="tinker://"),
    load_case("load-path-two-parts", "path", path=lambda c: c.env.a_weights.rsplit("/", 1)[0]),
    load_case("load-path-four-parts", "path", path=lambda c: c.env.a_weights + "/extra"),
    load_case(
        "load-path-dotdot-name", "path", path=lambda c: c.env.a_weights.rsplit("/", 1)[0] + "/.."
    ),
    load_case(
        "load-path-bad-segment",
        "path",
        path=lambda c: c.env.a_weights.replace("/weights/", "/bogus/"),
    ),
    load_case("load-path-sampler-snapshot", "path", path=lambda c: c.env.a_sampler_path),
    load_case(
        "load-path-other-tenant",
        ("path", "checkpoint"),
        status=(404,),
        path=lambda c: c.env.b_weights,
    ),
    load_case(
        "load-path-nonexistent",
        ("path", "checkpoint"),
        status=(404,),
        path=lambda c: c.env.a_weights.replace("/w1", "/never-saved"),
    ),
    load_case("load-path-other-rank", ("path", "checkpoint"), path=lambda c: c.env.a_rank8_weights),
    load_case(  # create-via-load names the new model's seq id (a 500 once: None < 0)
        "load-create-model_seq_id-missing",
        "model_seq_id",
        then="none",
        model_id=_DROP,
        seq_id=_DROP,
        session_id=lambda c: c.env.a.session(),
    ),
    load_case("load-optimizer-missing", "optimizer", optimizer=_DROP),
    load_case("load-optimizer-string", "optimizer", optimizer="yes please"),
    load_case("load-seq_id-zero", "seq_id", then="same", seq_id=0),
    load_case(
        "load-model_id-other-tenant",
        ("model_id", "model '"),
        then="same",
        status=(404,),
        model_id=lambda c: c.env.b_model,
    ),
]


# ---------------------------------------------------------------- create_model cases


def create_case(id, field, status=None, **overrides) -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        body: dict[str, Any] = {
            "session_id": ctx.env.a.session(),
            "model_seq_id": 0,
            "base_model": BASE,
            "lora_config": {"rank": 4},
            "type": "create_model",
        }
        for key, value in overrides.items():
            if value is _DROP:
                body.pop(key)
            else:
                body[key] = value(ctx) if callable(value) else value
        return ctx.env.a.raw("/create_model", _dumps(body))

    return Case(id, send, field, "none", status)


def _reuse_model_seq_id(ctx: Ctx) -> httpx.Response:
    session = ctx.env.a.session()
    ctx.env.a.new_model(session=session, model_seq_id=0)
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 4},
    }
    return ctx.env.a.post("/create_model", body)


CREATE_MODEL: list[Case] = [
    create_case("create-rank-zero", "rank", lora_config={"rank": 0}),
    create_case("create-rank-negative", "rank", lora_config={"rank": -1}),
    create_case("create-rank-huge", "rank", lora_config={"rank": 10**6}),
    create_case("create-rank-2**70", "rank", lora_config={"rank": 2**70}),
    create_case("create-rank-string", "rank", lora_config={"rank": "big"}),
    create_case("create-lora-unknown-key", "alpha", lora_config={"rank": 4, "alpha": 99}),
    create_case("create-base-unknown", "base_model", base_model="gpt-17-ultra"),
    create_case("create-base-path-traversal", "base_model", base_model="../../etc"),
    create_case(
        "create-optimizer-unknown-type", "optimizer_config", optimizer_config={"type": "sgd"}
    ),
    create_case("create-optimizer-dimuon", "optimizer_config", optimizer_config={"type": "dimuon"}),
    create_case("create-optimizer-string", "optimizer_config", optimizer_config="adamw"),
    create_case("create-model_seq_id-negative", "model_seq_id", model_seq_id=-1),
    create_case("create-model_seq_id-string", "model_seq_id", model_seq_id="zero"),
    Case("create-model_seq_id-duplicate", _reuse_model_seq_id, "model_seq_id"),
    create_case(
        "create-session-unknown", ("session", "s-nope"), status=(404,), session_id="s-nope"
    ),
    create_case(
        "create-session-other-tenant",
        "session",
        status=(404,),
        session_id=lambda c: c.env.b_session,
    ),
]


# ---------------------------------------------------------------- sampling cases


def sample_body(sampler: str, **params) -> dict[str, Any]:
    return {
        "sampling_session_id": sampler,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42, 99]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 1, **params},
        "type": "sample",
    }


def sample_case(id, field, params=None, status=None, **overrides) -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        body = sample_body(ctx.env.a_sampler, **(params or {}))
        for key, value in overrides.items():
            if value is _DROP:
                body.pop(key)
            else:
                body[key] = value(ctx) if callable(value) else value
        return ctx.env.a.raw("/asample", _dumps(body))

    return Case(id, send, field, "sample", status)


def _prompt(tokens) -> dict:
    return {"chunks": [{"type": "encoded_text", "tokens": [int(t) for t in tokens]}]}


def session_case(id, field, status=None, **body) -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        out = {"session_id": ctx.env.a_session, "sampling_session_seq_id": 7}
        out.update({k: (v(ctx) if callable(v) else v) for k, v in body.items()})
        return ctx.env.a.raw("/create_sampling_session", _dumps(out))

    return Case(id, send, field, "sample", status)


MT = "sampling_params.max_tokens"
SAMPLING: list[Case] = [
    sample_case(
        "sample-prompt-longer-than-context",
        "prompt",
        {"max_tokens": 1},
        prompt=_prompt(range(3, CONTEXT + 53)),
    ),
    sample_case("sample-max_tokens-beyond-context", MT, {"max_tokens": 10**6}),
    sample_case("sample-max_tokens-negative", MT, {"max_tokens": -1}),
    sample_case("sample-max_tokens-string", MT, {"max_tokens": "lots"}),
    sample_case("sample-num_samples-zero", "num_samples", num_samples=0),
    sample_case("sample-num_samples-negative", "num_samples", num_samples=-3),
    sample_case("sample-num_samples-huge", "num_samples", {"max_tokens": 1}, num_samples=100000),
    sample_case("sample-num_samples-string", "num_samples", num_samples="two"),
    sample_case(
        "sample-temperature-negative", "sampling_params.temperature", {"temperature": -1.0}
    ),
    sample_case("sample-temperature-nan", "sampling_params.temperature", {"temperature": nan}),
    sample_case("sample-temperature-inf", "sampling_params.temperature", {"temperature": inf}),
    sample_case("sample-temperature-string", "sampling_params.temperature", {"temperature": "hot"}),
    sample_case("sample-top_k-string", "sampling_params.top_k", {"top_k": "some"}),
    sample_case("sample-top_k-below-minus-one", "sampling_params.top_k", {"top_k": -7}),
    sample_case("sample-top_p-zero", "sampling_params.top_p", {"top_p": 0.0}),
    sample_case("sample-top_p-negative", "sampling_params.top_p", {"top_p": -0.5}),
    sample_case("sample-top_p-above-one", "sampling_params.top_p", {"top_p": 1.5}),
    sample_case("sample-top_p-nan", "sampling_params.top_p", {"top_p": nan}),
    sample_case("sample-seed-2**64", "sampling_params.seed", {"seed": 2**64}),
    sample_case("sample-seed-float", "sampling_params.seed", {"seed": 1.5}),
    sample_case("sample-seed-negative", "sampling_params.seed", {"seed": -1}),
    sample_case("sample-stop-mixed", "sampling_params.stop", {"stop": ["\n", 7]}),
    sample_case("sample-stop-out-of-vocab-id", "sampling_params.stop", {"stop": [VOCAB + 1000]}),
    sample_case("sample-stop-negative-id", "sampling_params.stop", {"stop": [-2]}),
    sample_case("sample-stop-empty-string", "sampling_params.stop", {"stop": [""]}),
    sample_case(
        "sample-topk_prompt_logprobs-negative",
        "topk_prompt_logprobs",
        prompt_logprobs=True,
        topk_prompt_logprobs=-1,
    ),
    sample_case(
        "sample-topk_sample_logprobs-negative", "topk_sample_logprobs", topk_sample_logprobs=-2
    ),
    sample_case(
        "sample-topk_sample_logprobs-huge", "topk_sample_logprobs", topk_sample_logprobs=10**7
    ),
    sample_case(
        "sample-prompt_logprobs_last_n-zero",
        "prompt_logprobs_last_n",
        prompt_logprobs=True,
        prompt_logprobs_last_n=0,
    ),
    sample_case(
        "sample-prompt_logprobs_last_n-too-big",
        "prompt_logprobs_last_n",
        prompt_logprobs=True,
        prompt_logprobs_last_n=10**6,
    ),
    sample_case(
        "sample-prompt_logprobs_last_n-without-prompt_logprobs",
        "prompt_logprobs_last_n",
        prompt_logprobs_last_n=2,
    ),
    sample_case("sample-prompt_alt_tokens_k", "prompt_alt_tokens_k", prompt_alt_tokens_k=3),
    sample_case("sample-prompt-empty", "prompt", prompt={"chunks": []}),
    sample_case("sample-prompt-empty-chunk", "prompt", prompt=_prompt([])),
    sample_case("sample-prompt-out-of-vocab", "prompt", prompt=_prompt([5, VOCAB + 3])),
    sample_case("sample-prompt-negative-token", "prompt", prompt=_prompt([5, -9])),
    sample_case(
        "sample-prompt-image-chunk",
        "prompt",
        prompt={"chunks": [{"type": "image", "data": "iVBORw0KGgo=", "format": "png"}]},
    ),
    sample_case(
        "sample-sampler-unknown",
        ("sampling_session_id", "sampler-nope"),
        status=(400, 404),
        sampling_session_id="sampler-nope",
    ),
    sample_case(
        "sample-sampler-other-tenant",
        ("sampling_session_id", "sampler '"),
        status=(404,),
        sampling_session_id=lambda c: c.env.b_sampler,
    ),
    sample_case(
        "sample-no-target", ("sampling_session_id", "base_model"), sampling_session_id=_DROP
    ),
    sample_case(
        "sample-model_path-other-tenant",
        ("model_path", "checkpoint"),
        status=(404,),
        sampling_session_id=_DROP,
        model_path=lambda c: c.env.b_sampler_path,
    ),
    session_case("sampling_session-model_path-not-tinker", "model_path", model_path="/etc/passwd"),
    session_case(
        "sampling_session-model_path-other-tenant",
        ("model_path", "checkpoint"),
        status=(404,),
        model_path=lambda c: c.env.b_sampler_path,
    ),
    session_case(
        "sampling_session-model_path-nonexistent",
        ("model_path", "checkpoint"),
        status=(404,),
        model_path=lambda c: c.env.a_sampler_path.replace("/s1", "/nothing"),
    ),
    session_case("sampling_session-base-unknown", "base_model", base_model="nope-7b"),
    session_case(
        "sampling_session-session-other-tenant",
        "session",
        status=(404,),
        session_id=lambda c: c.env.b_session,
        base_model=BASE,
    ),
]


# ---------------------------------------------------------------- futures, runs, bodies, auth


def _future_of_b(ctx: Ctx) -> str:
    b = ctx.env.b
    r = b.post("/asample", sample_body(ctx.env.b_sampler, max_tokens=1))
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def future_case(id, body_fn, field) -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        return ctx.env.a.raw("/retrieve_future", _dumps(body_fn(ctx)))

    return Case(id, send, field, direct=True)


def get_case(id, path_fn, field, status=None, method="GET", who="a") -> Case:
    def send(ctx: Ctx) -> httpx.Response:
        return getattr(ctx.env, who).http.request(method, path_fn(ctx))

    return Case(id, send, field, status=status)


def raw_case(id, route, content: bytes, field="body", then="none", who="a") -> Case:
    return Case(id, lambda c: getattr(c.env, who).raw(route, content), field, then)


def _b_run(ctx: Ctx) -> str:
    return ctx.env.b_model


MISC: list[Case] = [
    future_case("future-unknown-id", lambda c: {"request_id": "0" * 32}, "request_id"),
    future_case("future-other-tenant", lambda c: {"request_id": _future_of_b(c)}, "request_id"),
    future_case("future-missing-request_id", lambda c: {}, "request_id"),
    future_case("future-request_id-int", lambda c: {"request_id": 12345}, "request_id"),
    future_case("future-request_id-huge", lambda c: {"request_id": "r" * 100_000}, "request_id"),
    get_case("runs-offset-negative", lambda c: "/training_runs?offset=-1", "offset"),
    get_case("runs-limit-negative", lambda c: "/training_runs?limit=-1", "limit"),
    get_case("runs-limit-zero", lambda c: "/training_runs?limit=0", "limit"),
    get_case("runs-offset-not-int", lambda c: "/training_runs?offset=abc", "offset"),
    get_case("checkpoints-offset-negative", lambda c: "/checkpoints?offset=-5", "offset"),
    get_case("checkpoints-limit-negative", lambda c: "/checkpoints?limit=-2", "limit"),
    get_case("checkpoints-limit-not-int", lambda c: "/checkpoints?limit=1.5", "limit"),
    get_case(
        "runs-other-tenant", lambda c: f"/training_runs/{c.env.b_model}", "training run", (404,)
    ),
    get_case(
        "runs-checkpoints-other-tenant",
        lambda c: f"/training_runs/{c.env.b_model}/checkpoints",
        "training run",
        (404,),
    ),
    get_case(
        "sampler-info-other-tenant", lambda c: f"/samplers/{c.env.b_sampler}", "sampler", (404,)
    ),
    get_case(
        "delete-checkpoint-other-tenant",
        lambda c: f"/training_runs/{c.env.b_model}/checkpoints/weights/bw",
        "checkpoint",
        (404,),
        "DELETE",
    ),
    get_case(
        "delete-checkpoint-nonexistent",
        lambda c: f"/training_runs/{c.env.a_donor}/checkpoints/weights/never",
        "checkpoint",
        (404,),
        "DELETE",
    ),
    get_case(
        "delete-checkpoint-bad-segment",
        lambda c: f"/training_runs/{c.env.a_donor}/checkpoints/bogus/w1",
        ("segment", "path"),
        None,
        "DELETE",
    ),
    get_case(
        "delete-checkpoint-dotdot-name",
        lambda c: f"/training_runs/{c.env.a_donor}/checkpoints/weights/%2e%2e",
        ("name", "path", "checkpoint"),
        None,
        "DELETE",
    ),
    raw_case(
        "weights_info-path-not-tinker",
        "/weights_info",
        b'{"tinker_path": "/etc/passwd"}',
        "tinker_path",
    ),
    Case(
        "weights_info-other-tenant",
        lambda c: c.env.a.post("/weights_info", {"tinker_path": c.env.b_weights}),
        ("tinker_path", "checkpoint"),
        status=(404,),
    ),
    Case(
        "weights_info-nonexistent",
        lambda c: c.env.a.post("/weights_info", {"tinker_path": c.env.a_weights + "x"}),
        ("tinker_path", "checkpoint"),
        status=(404,),
    ),
    raw_case("weights_info-missing-path", "/weights_info", b"{}", "tinker_path"),
    raw_case("weights_info-array-body", "/weights_info", b"[1, 2]", ("body", "tinker_path")),
    raw_case("weights_info-path-int", "/weights_info", b'{"tinker_path": 5}', "tinker_path"),
    Case(
        "get_info-other-tenant",
        lambda c: c.env.a.post("/get_info", {"model_id": c.env.b_model}),
        ("model_id", "model '"),
        status=(404,),
    ),
    Case(
        "get_info-unknown",
        lambda c: c.env.a.post("/get_info", {"model_id": "x:train:9"}),
        ("model_id", "x:train:9"),
        status=(400, 404),
    ),
    # bodies that are not the JSON object a route expects
    raw_case("json-optim-not-json", "/optim_step", b"{model_id: oops", then="same"),
    raw_case("json-optim-array", "/optim_step", b"[]", then="same"),
    raw_case("json-optim-string", "/optim_step", b'"optim_step"', then="same"),
    raw_case("json-optim-empty", "/optim_step", b"", then="same"),
    raw_case("json-save-not-json", "/save_weights", b"\xff\xfe", then="same"),
    raw_case("json-create_model-array", "/create_model", b'[{"base_model": "tiny-qwen3"}]'),
    raw_case("json-create_model-null", "/create_model", b"null"),
    raw_case("json-asample-not-json", "/asample", b"{'single': 'quotes'}", then="sample"),
    raw_case("json-asample-number", "/asample", b"42", then="sample"),
    raw_case("json-retrieve-not-json", "/retrieve_future", b"request_id=1"),
    raw_case("json-create_session-array", "/create_session", b"[]"),
    raw_case("json-deeply-nested", "/optim_step", b"[" * 100_000 + b"]" * 100_000, then="same"),
    # missing or bad X-API-Key
    Case(
        "auth-missing-create_model",
        lambda c: c.env.nokey.post(
            "/create_model",
            {
                "session_id": c.env.a_session,
                "model_seq_id": 99,
                "base_model": BASE,
                "lora_config": {"rank": 4},
            },
        ),
        "X-API-Key",
        status=(401,),
    ),
    Case(
        "auth-bad-forward_backward",
        lambda c: c.env.badkey.proto(fb(c.model, c.seq)),
        "X-API-Key",
        "same",
        (401,),
    ),
    Case(
        "auth-missing-optim_step",
        lambda c: c.env.nokey.optim(c.model, c.seq),
        "X-API-Key",
        "same",
        (401,),
    ),
    Case(
        "auth-missing-retrieve_future",
        lambda c: c.env.nokey.post("/retrieve_future", {"request_id": "x"}),
        "X-API-Key",
        status=(401,),
    ),
    Case(
        "auth-missing-training_runs",
        lambda c: c.env.nokey.http.get("/training_runs"),
        "X-API-Key",
        status=(401,),
    ),
    Case(
        "auth-bad-asample",
        lambda c: c.env.badkey.post("/asample", sample_body(c.env.a_sampler)),
        "X-API-Key",
        "sample",
        (401,),
    ),
    Case(
        "auth-missing-telemetry",
        lambda c: c.env.nokey.post("/telemetry", {"events": []}),
        "X-API-Key",
        status=(401,),
    ),
]

CASES = FORWARD_BACKWARD + OPTIM_STEP + CHECKPOINTS + CREATE_MODEL + SAMPLING + MISC


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 110


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_cleanly(env: Env, case: Case) -> None:
    run_case(case, env)


def test_foreign_checkpoint_survives_a_delete_attempt(env: Env) -> None:
    """After the hostile DELETE cases, tenant B's checkpoint is still listed and loadable."""
    env.a.http.delete(f"/training_runs/{env.b_model}/checkpoints/weights/bw")
    r = env.b.http.get(f"/training_runs/{env.b_model}/checkpoints")
    assert r.status_code == 200 and env.b_weights in r.text, r.text


# ---------------------------------------------------------------- through the official SDK


@pytest.fixture(scope="module")
def sdk(env: Env):
    client = tinker.ServiceClient(base_url=env.url, api_key=A_KEY)
    yield client
    client.close("success").result(timeout=HTTP_TIMEOUT)  # ends the session: its models unload


def _sdk_training(sdk, env: Env):
    """An SDK training client whose model has accumulated gradients after one step."""
    training = sdk.create_lora_training_client(BASE, rank=4).result(timeout=HTTP_TIMEOUT)
    training.forward_backward(datums(1), "cross_entropy").result(timeout=HTTP_TIMEOUT)
    training.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=HTTP_TIMEOUT)
    training.forward_backward(datums(2), "cross_entropy").result(timeout=HTTP_TIMEOUT)
    return training


def _load_state(training, path: str):
    """``TrainingClient.load_state``: deprecated in SDK 0.38 (the warning is asserted), and
    still the SDK's only way to load into an existing model, the route this case refuses."""
    with pytest.warns(FutureWarning, match=r"TrainingClient\.load_state\*\(\) is deprecated"):
        return training.load_state(path)


def _nan_weights() -> list[tt.Datum]:
    out = datums(3)
    d = out[1]
    n = len(d.loss_fn_inputs["target_tokens"].data)
    weights = tt.TensorData(data=[math.nan] * n, dtype="float32", shape=[n])
    out[1] = tt.Datum(
        model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "weights": weights}
    )
    return out


SDK_CASES: list[tuple[str, Callable, str | tuple[str, ...]]] = [
    (
        "sdk-forward_backward-nan-weights",
        lambda t, s, e: t.forward_backward(_nan_weights(), "cross_entropy"),
        "weights",
    ),
    (
        "sdk-forward-nan-weights",
        lambda t, s, e: t.forward(_nan_weights(), "cross_entropy"),
        "weights",
    ),
    (
        "sdk-optim-lr-nan",
        lambda t, s, e: t.optim_step(tt.AdamParams(learning_rate=math.nan)),
        "learning_rate",
    ),
    (
        "sdk-optim-beta2-one",
        lambda t, s, e: t.optim_step(tt.AdamParams(learning_rate=1e-3, beta2=1.0)),
        "beta2",
    ),
    ("sdk-save-state-bad-name", lambda t, s, e: t.save_state("../escape"), "path"),
    (
        "sdk-load-state-other-tenant",
        lambda t, s, e: _load_state(t, e.b_weights),
        ("path", "checkpoint"),
    ),
    ("sdk-create-rank-zero", lambda t, s, e: s.create_lora_training_client(BASE, rank=0), "rank"),
    (
        "sdk-from-state-other-tenant",
        lambda t, s, e: s.create_training_client_from_state(e.b_weights),
        ("path", "checkpoint"),
    ),
    (
        "sdk-sample-num_samples-zero",
        lambda t, s, e: _sampling(s).sample(
            tt.ModelInput.from_ints([5, 6]), 0, tt.SamplingParams(max_tokens=2)
        ),
        "num_samples",
    ),
    (
        "sdk-sample-seed-2**64",
        lambda t, s, e: _sampling(s).sample(
            tt.ModelInput.from_ints([5, 6]), 1, tt.SamplingParams(max_tokens=2, seed=2**64)
        ),
        "seed",
    ),
    (
        "sdk-sample-temperature-negative",
        lambda t, s, e: _sampling(s).sample(
            tt.ModelInput.from_ints([5, 6]), 1, tt.SamplingParams(max_tokens=2, temperature=-1.0)
        ),
        "temperature",
    ),
]


def _sampling(sdk):
    client = sdk.create_sampling_client(base_model=BASE)
    if hasattr(client, "result"):
        client = client.result(timeout=HTTP_TIMEOUT)
    return client


def _resolve(x: Any) -> Any:
    for _ in range(3):  # APIFuture / concurrent future, possibly nested
        if hasattr(x, "result") and callable(x.result):
            x = x.result(timeout=HTTP_TIMEOUT)
        else:
            break
    return x


@pytest.mark.parametrize("name,call,field", SDK_CASES, ids=[c[0] for c in SDK_CASES])
def test_refused_cleanly_through_the_sdk(env: Env, sdk, name: str, call: Callable, field) -> None:
    training = _sdk_training(sdk, env)
    model = training.model_id
    before = state_of(env.service, model)
    assert_nonzero_history(before)
    problems: list[str] = []
    try:
        out = _resolve(call(training, sdk, env))
        problems.append(f"SDK call SUCCEEDED: {excerpt(repr(out))}")
    except (FutureTimeout, TimeoutError) as e:
        problems.append(f"SDK call hangs (5xx retried forever?): {type(e).__name__}")
    except Exception as e:  # noqa: BLE001 - the refusal
        if not names(str(e), field):
            problems.append(
                f"SDK error does not name {field!r}: {type(e).__name__}: {excerpt(str(e))}"
            )
    # the model's next operation still runs
    if not name.startswith("sdk-create") and not name.startswith("sdk-from"):
        try:
            training.forward(datums(4), "cross_entropy").result(timeout=HTTP_TIMEOUT)
        except Exception as e:  # noqa: BLE001
            problems.append(f"follow-up SDK forward failed: {type(e).__name__}: {excerpt(str(e))}")
    changed = differences(before, state_of(env.service, model))
    if changed:
        problems.append(f"model state changed: {changed[:4]}")
    assert not problems, "\n".join(problems)

"""`make install-check`: furlong as a user installs it, not as the checkout runs it.

1. Build the sdist and, from it, the wheel (``python -m build``); ``twine check --strict``.
2. A fresh venv with the core dependencies only (torch from constraints.txt, then the wheel):
   ``pip check``, ``furlong --version``, ``furlong env``, and a shortened demo recipe (a few
   warm-up and RL steps) that must build the fused CPU kernels from the wheel's own sources
   into an empty cache, not fall back to ATen's ops; ``furlong serve`` refuses in one line
   naming the ``server`` extra.
3. The same venv plus ``[server]``: ``furlong serve`` on a free port and the README's SDK
   example against it.

Every command runs from an empty directory with no PYTHONPATH, so nothing of the checkout is
importable; the check fails if furlong is imported from anywhere but the venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ["warmup.steps=4", "run.steps=2", "run.eval_every=1", "task.eval_size=8"]
READY = re.compile(r"furlong serve: .* on (http://\S+) \(TINKER_BASE_URL\)")
FALLBACK = ("fused CPU kernels unavailable", "package is incomplete")


class CheckFailed(Exception):
    pass


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> str:
    """``cmd``'s stdout and stderr; a nonzero exit fails the check with both."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def refused(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """``cmd``'s one-line usage error (exit 2); anything else fails the check."""
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    if done.returncode != 2 or len(lines) != 1:
        raise CheckFailed(
            f"{' '.join(cmd)}: expected a one-line refusal (exit 2), got exit "
            f"{done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return lines[0]


def clean_env(home: Path) -> dict[str, str]:
    """The caller's environment without what would make the checkout importable or change
    what a user sees; the furlong cache starts empty (the kernels are built from the wheel)."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONWARNINGS", "FURLONG_FUSED_KERNELS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"FURLONG_CACHE": str(home / "cache"), "HF_HUB_OFFLINE": "1"}


def build(dist: Path, python: str) -> Path:
    """The wheel built from the sdist; both pass twine's metadata check."""
    env = dict(os.environ)
    run([python, "-m", "build", "--outdir", str(dist), str(ROOT)], ROOT, env)
    run([python, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())], ROOT, env)
    (wheel,) = dist.glob("furlong-*.whl")
    return wheel


def core_install(venv: Path, wheel: Path, base_python: str, work: Path, env: dict) -> Path:
    run([base_python, "-m", "venv", str(venv)], work, env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    run([*pip, *constraints, "torch==2.13.0"], work, env)  # the local CPU wheel
    run([*pip, *constraints, str(wheel)], work, env)
    run([str(venv / "bin" / "python"), "-m", "pip", "check"], work, env)
    return venv / "bin"


def check_core(bin_dir: Path, work: Path, env: dict) -> dict:
    out = run([str(bin_dir / "furlong"), "--version"], work, env).strip()
    want = _package_version()
    if out != f"furlong {want}":
        raise CheckFailed(f"furlong --version printed {out!r}, expected 'furlong {want}'")
    where = run([str(bin_dir / "python"), "-c", "import sys; print(sys.path)"], work, env)
    if str(ROOT) in where:
        raise CheckFailed(f"the checkout is on the venv's sys.path: {where}")
    demo = run([str(bin_dir / "furlong"), "demo", "--out", str(work / "demo"), *DEMO], work, env)
    if any(text in demo for text in FALLBACK):
        raise CheckFailed(f"the demo ran without the fused kernels:\n{demo}")
    built = list((Path(env["FURLONG_CACHE"]) / "kernels").glob("fused_ops-*.so"))
    if not built:
        raise CheckFailed(f"the demo built no fused kernels into {env['FURLONG_CACHE']}")
    lines = (work / "demo" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    if steps != [0, 1, 2] or not (work / "demo" / "policy" / "config.json").is_file():
        raise CheckFailed(f"the demo logged steps {steps} (0, 1, 2 expected) or no policy/")
    report = json.loads(run([str(bin_dir / "furlong"), "env", "--json"], work, env))
    if not report["location"].startswith(str(bin_dir.parent)):
        raise CheckFailed(f"furlong was imported from {report['location']}, not the venv")
    if report["fused_kernels"] != "built" or any(report["extras"].values()):
        raise CheckFailed(f"expected built kernels and no extras in a core install: {report}")
    line = refused([str(bin_dir / "furlong"), "serve", "--port", "0"], work, env)
    if "pip install 'furlong[server]'" not in line:
        raise CheckFailed(f"furlong serve without [server] did not name the extra: {line}")
    return report


def _package_version() -> str:
    text = (ROOT / "furlong" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.M)
    assert match, "furlong/__init__.py sets __version__"
    return match.group(1)


def sdk_example() -> str:
    """The README's Python block that drives the service through the tinker SDK."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if "ServiceClient" in b]
    return block


def check_server(bin_dir: Path, wheel: Path, work: Path, env: dict) -> str:
    pip = [
        str(bin_dir / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        str(ROOT / "constraints.txt"),
    ]
    run([*pip, f"{wheel}[server]"], work, env)
    run([str(bin_dir / "python"), "-m", "pip", "check"], work, env)
    serve = [str(bin_dir / "furlong"), "serve", "--base-model", "Qwen/Qwen3-8B-Base=tiny-qwen3"]
    serve += ["--port", "0", "--state-dir", str(work / "state")]
    server = subprocess.Popen(serve, cwd=work, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = _ready_url(server)
        (work / "sdk_example.py").write_text(sdk_example())
        client = env | {"TINKER_BASE_URL": url, "TINKER_API_KEY": "tml-local"}
        out = run([str(bin_dir / "python"), "sdk_example.py"], work, client, timeout=600)
        if "RL 19: reward" not in out or "tinker://" not in out:
            raise CheckFailed(f"the SDK example did not finish its 20 RL steps:\n{out}")
        return out
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _ready_url(server: subprocess.Popen) -> str:
    assert server.stderr is not None
    seen = []
    for line in server.stderr:  # the ready line comes once the port listens
        seen.append(line)
        match = READY.search(line)
        if match:
            return match.group(1)
    raise CheckFailed(
        f"furlong serve exited {server.wait()} before its ready line:\n{''.join(seen)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--python", default="python3", help="the interpreter the venv is made from")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="furlong-install-check-"))
    env, work = clean_env(home), home / "work"
    work.mkdir()
    start = time.perf_counter()

    def step(what: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {what}", flush=True)

    try:
        step("building the sdist and the wheel from it; twine check")
        wheel = build(home / "dist", sys.executable)
        step(f"a fresh venv with the core dependencies and {wheel.name}")
        bin_dir = core_install(home / "venv", wheel, args.python, work, env)
        step("furlong --version, a shortened demo, furlong env")
        report = check_core(bin_dir, work, env)
        step(f"core: fused kernels {report['fused_kernels']} ({report['fused_kernels_detail']})")
        step("adding [server]: furlong serve and the README's SDK example")
        out = check_server(bin_dir, wheel, work, env)
        step(f"server: {[line for line in out.splitlines() if line.startswith('RL 19')][0]}")
    except CheckFailed as e:
        print(f"install-check FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    step("install-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The plugin through `vllm serve` (vLLM's OpenAI-compatible HTTP server), not only `vllm.LLM`:
three servers, one after the other, each a subprocess on a free localhost port with dummy weights
of an 8B-class shape's config (`atskv.eval.vllm_speed.write_shape`), token ids as prompts and no
tokenizer (`--skip-tokenizer-init`):

  vanilla         vLLM's own attention backend
  streaming_llm   `--attention-backend CUSTOM --additional-config '{"atskv": {"selector":
                  "streaming_llm", "budget": 1.0}}'`: budget 1.0 is dense, so its greedy tokens
                  must be vanilla's (`identity`)
  quest           `{"atskv": {"selector": "quest", "budget": 0.05, "dense_layers": 2}}`: that it
                  serves at all (its tokens may differ from vanilla's)

Each server: /health polled until 200, then PROMPTS prompts of CONTEXT random token ids (fixed
seed, `vllm_speed.prompts`) sent one at a time to /v1/completions (temperature 0, ignore_eos,
return_token_ids), its generated token ids kept; the server is stopped (SIGINT to its process group, SIGKILL after a
grace period) whatever happened, and the GPU's memory awaited before the next one starts. A JSON
line per server in OUT, each server's log beside it (OUT's stem.LABEL.log). Exit status 1 when a
server does not come up or answer, or when budget 1.0 does not repeat vanilla's tokens.

    python benchmarks/vllm_serve_check.py --out serve.jsonl [--shape llama3.1-8b]
    python benchmarks/vllm_serve_check.py --out serve.jsonl --dry_run   (commands only)

The HTTP calls are the standard library's (urllib); vLLM and the plugin are found through the
environment's PYTHONPATH (the plugin's entry point: `benchmarks/device/vllm_env.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from atskv.eval.vllm_speed import first_differences, prompts, write_shape
from atskv.runtime.vllm.config import WORKER

MODEL_NAME = "atskv-serve-check"  # --served-model-name, and the requests' "model"
SERVERS = [  # (label, the "atskv" entry of --additional-config; None: vanilla vLLM)
    ("vanilla", None),
    ("streaming_llm", {"selector": "streaming_llm", "budget": 1.0}),
    ("quest", {"selector": "quest", "budget": 0.05, "dense_layers": 2}),
]
# no proxy for localhost, whatever the environment says (urllib honours http_proxy otherwise)
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(shape_dir: Path, port: int, settings: dict | None, max_model_len: int) -> list[str]:
    """`vllm serve` as a module (vLLM's console script `vllm` is `vllm.entrypoints.cli.main:main`)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(shape_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
        "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16", "--seed", "0",
        "--max-model-len", str(max_model_len), "--gpu-memory-utilization", "0.85", "--enforce-eager",
        "--no-enable-prefix-caching", "--max-num-seqs", "4", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if settings is not None:
        command += ["--attention-backend", "CUSTOM", "--worker-cls", WORKER, "--additional-config",
                    json.dumps({"atskv": settings})]  # fmt: skip
    return command


def server_environment() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    # vllm_env.sh sets it to 0 for `vllm.LLM` in one process; the server's AsyncLLM always runs its
    # engine core in a process of its own, so it is dropped to leave the server as it ships
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def wait_healthy(process: subprocess.Popen, base: str, timeout_s: float, started: float) -> float:
    """Seconds from the start until GET /health answers 200 (the port is bound but not listening
    while the engine starts: connections are refused until then)."""
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise ServerError(f"the server exited with status {process.returncode} before /health answered")
        try:
            with OPENER.open(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):  # refused, 503 (HTTPError), timed out
            pass
        time.sleep(1.0)
    raise ServerError(f"/health did not answer 200 within {timeout_s:.0f} s")


def post_json(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with OPENER.open(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read()[:2000].decode(errors="replace")
        raise ServerError(f"POST {url}: HTTP {error.code}: {detail}") from None


def greedy_tokens(base: str, prompt: list[int], new_tokens: int, timeout_s: float) -> list[int]:
    """One prompt of token ids through /v1/completions: its greedy token ids."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    answer = post_json(base + "/v1/completions", body, timeout_s)
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise ServerError(f"{len(choices)} choices for one prompt: {json.dumps(answer)[:1000]}")
    choice = choices[0]
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list) or len(tokens) != new_tokens:
        raise ServerError(f"wanted {new_tokens} token ids, got {tokens!r} (finish_reason "
                          f"{choice.get('finish_reason')!r}): {json.dumps(answer)[:1000]}")  # fmt: skip
    seen = choice.get("prompt_token_ids")
    if seen is not None and seen != prompt:
        raise ServerError(f"the server's prompt is not the one sent ({len(seen)} ids, {len(prompt)} sent)")
    return tokens


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop(process: subprocess.Popen, grace_s: float) -> str:
    """SIGINT to the server's process group (its engine core with it, as Ctrl-C would), SIGKILL to
    what is left after `grace_s`. Returns how it ended."""
    pgid, how = process.pid, "exited by itself"
    if process.poll() is None:
        how = "SIGINT"
        try:
            os.killpg(pgid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            how = "SIGKILL after SIGINT"
            os.killpg(pgid, signal.SIGKILL)
            process.wait()
    deadline = time.monotonic() + grace_s  # the engine core may outlive the API server
    while process_group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if process_group_alive(pgid):
        how += ", group SIGKILL"
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return how


def gpu_memory_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
        return max(int(float(x)) for x in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def wait_gpu_free(limit_mib: int = 2048, timeout_s: float = 60.0) -> str:
    """Until every GPU uses less than `limit_mib` (nvidia-smi), at most `timeout_s`."""
    time.sleep(3.0)
    deadline = time.monotonic() + timeout_s
    used = gpu_memory_used_mib()
    while used is not None and used >= limit_mib and time.monotonic() < deadline:
        time.sleep(2.0)
        used = gpu_memory_used_mib()
    return "nvidia-smi unavailable" if used is None else f"{used} MiB in use"


def backend_lines(log: Path) -> list[str]:
    """vLLM's 'Using ... backend.' lines (vllm/platforms/cuda.py) and the plugin's own, to read."""
    if not log.is_file():
        return []
    pattern = re.compile(r"Using \S+ (attention )?backend|atskv")
    return [line.strip()[-200:] for line in log.read_text(errors="replace").splitlines() if pattern.search(line)][:6]


def log_tail(log: Path, lines: int = 15) -> str:
    if not log.is_file():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_server(label: str, settings: dict | None, args, token_ids: list[list[int]], log: Path) -> dict:
    """One server from start to stop; its row (`error` set where it failed)."""
    port = free_port()
    command = serve_command(args.shape_dir, port, settings, args.max_model_len)
    row = {"label": label, "atskv": settings, "command": shlex.join(command), "log": str(log), "healthy_s": None,
           "tokens": [], "error": None}  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    print(f"[{label}] starting: {row['command']}", flush=True)
    started = time.monotonic()
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=server_environment(), start_new_session=True)  # fmt: skip
    try:
        row["healthy_s"] = round(wait_healthy(process, base, args.health_timeout, started), 1)
        t0 = time.monotonic()
        row["tokens"] = [greedy_tokens(base, p, args.new_tokens, args.request_timeout) for p in token_ids]
        row["requests_s"] = round(time.monotonic() - t0, 2)
    except Exception as error:  # recorded, the server stopped, the next one tried
        row["error"] = f"{type(error).__name__}: {error}"
    finally:
        row["stopped"] = stop(process, args.grace)
        row["gpu_after"] = wait_gpu_free()
    row["backend_lines"] = backend_lines(log)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.1-8b", help="an 8B-class shape (atskv.eval.shapes)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per server; the logs beside it")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--context", type=int, default=2048, help="token ids per prompt")
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--max_model_len", type=int, default=8192)
    parser.add_argument("--health_timeout", type=float, default=300.0, help="seconds for a server to come up")
    parser.add_argument("--request_timeout", type=float, default=120.0)
    parser.add_argument("--grace", type=float, default=30.0, help="seconds after SIGINT before SIGKILL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry_run", action="store_true", help="print the servers' commands only")
    args = parser.parse_args()

    args.shape_dir = write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    vocab = json.loads((args.shape_dir / "config.json").read_text())["vocab_size"]
    if args.context + args.new_tokens > args.max_model_len:
        parser.error(f"--context {args.context} + --new_tokens {args.new_tokens} > --max_model_len")
    if args.dry_run:
        for label, settings in SERVERS:
            print(f"{label}: {shlex.join(serve_command(args.shape_dir, 8000, settings, args.max_model_len))}")
        return 0

    token_ids = [p["prompt_token_ids"] for p in prompts(args.context, args.prompts, vocab, args.seed)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")  # this run's rows only

    def terminated(*_):  # `timeout` (the plan's stage) sends SIGTERM: an exception, so the server is stopped
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the server's stop
        sys.exit(143)

    signal.signal(signal.SIGTERM, terminated)

    rows: dict[str, dict] = {}
    for label, settings in SERVERS:
        log = args.out.with_name(f"{args.out.stem}.{label}.log")
        row = run_server(label, settings, args, token_ids, log)
        rows[label] = row
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if row["error"]:
            print(f"{label}: FAILED: {row['error']}", flush=True)
            print(f"--- {log} (tail) ---\n{log_tail(log)}\n---", flush=True)
        else:
            firsts = " | ".join(str(t[:8]) for t in row["tokens"])
            print(f"{label}: healthy in {row['healthy_s']:.1f} s, {len(row['tokens'])} prompts in "
                  f"{row['requests_s']:.1f} s; first tokens {firsts}", flush=True)  # fmt: skip
        print(f"{label}: stopped ({row['stopped']}), GPU after: {row['gpu_after']}; backend lines: "
              f"{row['backend_lines'] or 'none'}", flush=True)  # fmt: skip

    vanilla, dense, quest = rows["vanilla"], rows["streaming_llm"], rows["quest"]
    served = {label: not row["error"] and len(row["tokens"]) == args.prompts for label, row in rows.items()}
    identity = served["vanilla"] and served["streaming_llm"] and dense["tokens"] == vanilla["tokens"]
    line = f"identity: budget 1.0 == vanilla: {identity}"
    if served["vanilla"] and served["streaming_llm"] and not identity:
        line += f" (first differences at {first_differences(dense['tokens'], vanilla['tokens'])})"
    print(line)
    quest_line = f"quest (budget 0.05, 2 dense layers): served: {served['quest']}"
    if served["quest"] and served["vanilla"]:
        same = sum(a == b for a, b in zip(quest["tokens"], vanilla["tokens"]))
        quest_line += (f"; {same}/{args.prompts} prompts token-identical to vanilla "
                       f"(first differences at {first_differences(quest['tokens'], vanilla['tokens'])})")  # fmt: skip
    print(quest_line)
    failed = [label for label, ok in served.items() if not ok]
    if failed:
        print(f"FAILED: {', '.join(failed)} did not serve (logs beside {args.out})")
    return 0 if identity and not failed else 1


if __name__ == "__main__":
    sys.exit(main())

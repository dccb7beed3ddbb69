"""Prometheus metrics: scraped while load runs, the counters move with the calls made."""
from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import start_server
from metrale.worker.v1 import worker_pb2 as pb
from test_cli import free_port
from worker.client import Stopping, WorkerClient


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m, name, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_the_calls(tiny_model):
    port = free_port()
    server = start_server(tiny_model, worker_changes=dict(metrics_port=port))
    try:
        assert server.worker.metrics_port == port
        base = scrape(port)
        client = WorkerClient(server.address)
        base_info = client.info()
        stop, scrapes = threading.Event(), []

        def scraper():
            while not stop.is_set():
                scrapes.append(value(scrape(port), "metrale_rpc_total", method="Decode", code="OK"))

        t = threading.Thread(target=scraper)
        t.start()
        sessions = [client.session(64, stopping=Stopping(max_new_tokens=10, ignore_eos=True)) for _ in range(3)]
        client.prefill([pb.PrefillItem(sequence_id=s.seq_id, token_ids=[1, 2, 3]) for s in sessions])
        decodes = 0
        for _ in range(9):
            client.decode([s.seq_id for s in sessions])
            decodes += 1
        try:
            client.decode([12345])
        except Exception:
            pass
        live = client.info().live_sequences
        used = client.info().total_blocks - client.info().free_blocks
        steps = client.info().steps  # 9 steps of 3 sequences, one prefill of 9 tokens
        assert steps.decode_steps - base_info.steps.decode_steps == 9
        assert steps.decode_sequences - base_info.steps.decode_sequences == 27
        assert (steps.prefill_calls - base_info.steps.prefill_calls, steps.prefill_tokens - base_info.steps.prefill_tokens) \
            == (1, 9)
        assert steps.decode_device_ns > base_info.steps.decode_device_ns and steps.prefill_device_ns > 0
        for s in sessions:
            s.release()
        stop.set()
        t.join()
        m = scrape(port)
        assert scrapes == sorted(scrapes), "a counter went down between scrapes"
        assert value(m, "metrale_rpc_total", method="Decode", code="OK") - \
            value(base, "metrale_rpc_total", method="Decode", code="OK") == decodes
        assert value(m, "metrale_rpc_total", method="Decode", code="NOT_FOUND") == 1
        assert value(m, "metrale_rpc_total", method="AllocSequence", code="OK") - \
            value(base, "metrale_rpc_total", method="AllocSequence", code="OK") == 3
        assert value(m, "metrale_time_to_first_token_seconds_count") - \
            value(base, "metrale_time_to_first_token_seconds_count") == 3
        # 3 sequences x 9 steps, each after the previous token: 27 inter-token gaps.
        assert value(m, "metrale_inter_token_seconds_count") - value(base, "metrale_inter_token_seconds_count") == 27
        assert value(m, "metrale_step_batch_size_sum", kind="decode") - \
            value(base, "metrale_step_batch_size_sum", kind="decode") == 27
        assert value(m, "metrale_generated_tokens_total") - value(base, "metrale_generated_tokens_total") == 30
        assert value(m, "metrale_decode_steps_total") - value(base, "metrale_decode_steps_total") == 9
        assert value(m, "metrale_decode_step_sequences_total") - value(base, "metrale_decode_step_sequences_total") == 27
        assert value(m, "metrale_prefill_tokens_total") - value(base, "metrale_prefill_tokens_total") == 9
        # A Generate stream's steps count with every other caller's.
        list(client.generate([5, 6], max_new_tokens=4, ignore_eos=True))
        after = client.info().steps
        assert (after.decode_steps - steps.decode_steps, after.decode_sequences - steps.decode_sequences) == (3, 3)
        assert (after.prefill_calls - steps.prefill_calls, after.prefill_tokens - steps.prefill_tokens) == (1, 2)
        assert live == 3 and used == 3 * 4
        assert value(m, "metrale_live_sequences") == 0
        assert value(m, "metrale_kv_blocks_used") == 0
        assert value(m, "metrale_kv_blocks_free") == client.info().free_blocks
        assert ("metrale_graph_hits_total", ()) in m
        # Each answered Decode's time split into its three stages.
        for stage in ("queued", "device", "reply"):
            assert value(m, "metrale_decode_stage_seconds_count", stage=stage) - \
                value(base, "metrale_decode_stage_seconds_count", stage=stage) == decodes
            assert value(m, "metrale_decode_stage_seconds_sum", stage=stage) > 0
        # Every Decode here was answered (none left in flight), and no sequence stopped early.
        assert m[("metrale_decode_steps_in_flight", ())] == 0
        assert m[("metrale_decode_steps_refused_total", ())] == 0
    finally:
        server.stop()


def test_inter_token_gaps_of_a_verify_and_of_finished_sequences():
    """Metrics._tokens on its own: a sequence's gap is measured from its previous token; a Verify's
    later tokens of one sequence come 0 s after the one before; a finished sequence is forgotten, and
    first tokens (Prefill) start the clock without a gap."""
    from engine.api import TokenResult
    from engine.sequence import FinishReason
    from worker.metrics import Metrics

    m = Metrics()
    gaps = []
    m.itl.observe = lambda v, n=1: gaps.extend([v] * n)

    def tok(seq_id, reason=FinishReason.NONE):
        return TokenResult(seq_id, 5, -0.1, [], reason, 10)

    m._tokens([tok(1), tok(2)], 10.0, first=True)
    assert gaps == []
    m._tokens([tok(1), tok(1), tok(1), tok(2, FinishReason.EOS)], 10.5, first=False)  # a Verify's step
    assert sorted(gaps) == [0.0, 0.0, 0.5, 0.5]
    gaps.clear()
    m._tokens([tok(1), tok(2), tok(3)], 11.0, first=False)  # 2 had finished: no gap from its old token; 3 is new
    assert gaps == [0.5]
    assert set(m._last_token) == {1, 2, 3}
    assert m.registry.get_sample_value("metrale_generated_tokens_total") == 9


def test_generate_streams_count_their_tokens_first_token_and_gaps(tiny_model):
    """Generate streams (ModelWorker's and the gateway service's, several at once): each stream's first token is one
    time-to-first-token observation, each later token one inter-token gap, and every token counts as generated."""
    import grpc

    from worker.gateway_pb import vpb, vpb_grpc

    port = free_port()
    server = start_server(tiny_model, worker_changes=dict(metrics_port=port))
    try:
        client = WorkerClient(server.address)
        base = scrape(port)
        lengths = (5, 3, 7)
        with grpc.insecure_channel(server.address) as channel:
            vllm = vpb_grpc.VllmEngineStub(channel)
            calls = [vllm.Generate(vpb.GenerateRequest(
                request_id=f"m{n}", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]), stream=True,
                sampling_params=vpb.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)))
                for n in lengths]
            assert len(list(client.generate([5, 6], max_new_tokens=4, ignore_eos=True))) == 4
            streamed = [sum(len(r.chunk.token_ids) for r in call) for call in calls]
        assert streamed == list(lengths)
        m = scrape(port)
        tokens, streams = sum(lengths) + 4, len(lengths) + 1
        assert value(m, "metrale_generated_tokens_total") - value(base, "metrale_generated_tokens_total") == tokens
        assert value(m, "metrale_time_to_first_token_seconds_count") - \
            value(base, "metrale_time_to_first_token_seconds_count") == streams
        assert value(m, "metrale_inter_token_seconds_count") - \
            value(base, "metrale_inter_token_seconds_count") == tokens - streams
    finally:
        server.stop()

"""The step-trace report: its token-delivery lines (which side of the socket a long gap between tokens is on) and its
per-request rows."""

from __future__ import annotations

from benchmarks.tools.step_trace import decode_gaps, delivery, per_request


def test_a_gap_only_the_client_sees_is_the_clients() -> None:
    sends = [10.0, 10.1, 10.2, 10.3]
    receives = [10.001, 10.101, 11.5, 11.501]  # chunks 3 and 4 sat 1.3 s in the client
    records = {
        "frontend": [{"kind": "sent", "rid": "a", "t": t} for t in sends] + [{"kind": "submit", "rid": "a", "t": 9.0}],
        "client": [{"kind": "chunks", "rid": "a", "times": receives}],
    }
    lines = delivery(records)
    assert lines[0] == ""
    assert lines[1] == "token gaps, frontend sends: p50/p90/p99/max 100/100/100/100 ms over 3 gaps"
    assert lines[2] == "token gaps, client receives: p50/p90/p99/max 100/1399/1399/1399 ms over 3 gaps"
    # Each receive against the frontend's latest send before it: 1, 1, 1200 and 1201 ms.
    assert lines[3] == "frontend send -> client receive: p50/p90/p99/max 1200/1201/1201/1201 ms over 4 chunks"


def test_since_drops_earlier_records_and_no_records_no_lines() -> None:
    records = {
        "frontend": [{"kind": "sent", "rid": "a", "t": t} for t in (1.0, 5.0, 5.5)],
        "client": [{"kind": "chunks", "rid": "a", "times": [1.01, 5.01, 5.51]}],
    }
    assert delivery(records, since=4.0)[1] == "token gaps, frontend sends: p50/p90/p99/max 500/500/500/500 ms over 1 gaps"
    assert delivery({"frontend": [], "worker0": []}) == []


def test_decode_rows_gaps_run_from_the_previous_steps_end() -> None:
    steps = [
        {"start": 0.0, "end": 0.2, "decodes": 0},  # a prefill: no row waited on it for a token
        {"start": 0.2, "end": 0.4, "decodes": 2},  # two rows, 200 ms after the prefill ended
        {"start": 0.41, "end": 0.42, "decodes": 3},  # three rows, 20 ms
    ]
    assert decode_gaps(steps) == ["", "token gaps of decode rows, model steps only: p50/p90/p99/max 20/200/200/200 ms "
                                      "over 5 gaps"]
    assert decode_gaps(steps[:1]) == []


def test_a_request_row_times_its_deferred_image_from_the_prepared_prompt_to_the_scheduler() -> None:
    """`--requests`: a request whose fresh image was written after its prompt left shows how long the scheduler
    waited for it (prepared -> MediaReady) and when the tokenizer had it processed and written."""
    rid = "r"
    records = {
        "frontend": [{"kind": "submit", "rid": rid, "read": 0.990, "t": 1.000}],
        "tokenizer0": [
            {"kind": "recv", "rid": rid, "t": 1.002},
            {"kind": "admitted", "rid": rid, "t": 1.005},
            {"kind": "prepared", "rid": rid, "hashed": 1.006, "processed": 1.006, "written": 1.008, "t": 1.010},
            {"kind": "landed", "rid": rid, "marks": [[1.010, 1.025, 1.027]], "t": 1.028},
        ],
        "scheduler0": [
            {"kind": "arrive", "rid": rid, "t": 1.011},
            {"kind": "media", "rid": rid, "images": 1, "t": 1.029},
        ],
        "worker0": [
            {"kind": "step", "start": 1.012, "end": 1.020, "seqs": 1, "decodes": 0, "tokens": 20},
            {"kind": "step", "start": 1.030, "end": 1.050, "seqs": 1, "decodes": 0, "tokens": 300, "vit": 0.005},
        ],
    }
    header, _, row = per_request(records).splitlines()
    assert "deferred images" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["0", "11.0"]
    assert cells[2] == "10.0; 2.0, 3.0, 5.0, 1.0 (1.0, 0.0, 2.0, 2.0)"
    assert cells[3] == "19.0 (15.0, 17.0)"  # MediaReady 19 ms after the prompt; processed at 15, written at 17
    assert cells[4:7] == ["1.0", "2", "38.0"]

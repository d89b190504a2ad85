"""Remote rewards (megaflow.rewards.remote) against loopback servers this test starts: the pickle and JSON
reward-server protocols, the VLM judge over an OpenAI-compatible chat API, timeouts, retries, a request's total
deadline (also while bytes trickle in), the answer-size cap (announced or not), the warning while a request waits,
wrong-length answers, and the config's one-line refusals. Needs: CPU, 1 process, 127.0.0.1."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import math
import pickle
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from megaflow.config import ConfigError, load_config
from megaflow.config import preflight as pf
from megaflow.rewards import build_multi_reward, build_reward, safe_score
from megaflow.rewards.remote import judge_score

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
FAST = {"timeout": 2.0, "retries": 0}


@contextlib.contextmanager
def serve(respond):
    """A loopback HTTP server on a free port, answering each POST with ``respond(path, body, n)`` ->
    (status, bytes) where n counts requests from 1; yields (url, list of (path, body) received)."""
    received, lock = [], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                received.append((self.path, body))
                n = len(received)
            status, out = respond(self.path, body, n)
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except OSError:  # the client gave up (timeout tests)
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _images() -> torch.Tensor:
    """Three smooth 32x32 images (flat colours and a gradient): JPEG keeps their means within 0.01."""
    ramp = torch.linspace(0, 1, 32).expand(32, 32)
    return torch.stack([torch.full((3, 32, 32), 0.2), torch.stack([ramp, ramp.T, 1 - ramp]),
                        torch.tensor([0.9, 0.5, 0.1]).view(3, 1, 1).expand(3, 32, 32)])


PROMPTS = ["a red circle", "a gradient", "an orange square"]
META = [{"id": 0, "tag": "x"}, {"id": 1, "tag": "yy"}, {"id": 2, "tag": "zzz"}]


def _decode_jpeg(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64) / 255.0


def test_pickle_protocol_returns_scores_in_order_and_sends_metadata():
    def respond(path, body, n):
        req = pickle.loads(body)
        return 200, pickle.dumps({"scores": [10.0 * m["id"] + len(m["tag"]) for m in req["meta_datas"]]})

    with serve(respond) as (url, received):
        reward = build_reward("remote", url=url + "/score", trust_pickle=True, **FAST)
        scores = reward(_images(), PROMPTS, META)
    torch.testing.assert_close(scores, torch.tensor([1.0, 12.0, 23.0]))
    path, body = received[0]
    sent = pickle.loads(body)
    assert path == "/score" and sent["prompts"] == PROMPTS and sent["meta_datas"] == META
    assert [_decode_jpeg(b).shape for b in sent["images"]] == [(32, 32, 3)] * 3


def test_pickle_outputs_are_read_by_the_judge_rule():
    with serve(lambda path, body, n: (200, pickle.dumps({"outputs": ["Yes, it is.", 0.25, "no"]}))) as (url, _):
        scores = build_reward("remote", url=url, trust_pickle=True, **FAST)(_images(), PROMPTS, META)
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.25, 0.0]))


def test_pickle_without_trust_is_refused_in_one_line():
    with pytest.raises(ValueError, match="trust_pickle = true") as e:
        build_multi_reward({"remote": 1.0}, kwargs={"remote": {"url": "http://127.0.0.1:9/"}})
    assert "\n" not in str(e.value) and "runs any code" in str(e.value)
    with pytest.raises(ValueError, match="trust_pickle"):
        build_reward("remote", url="http://127.0.0.1:9/", trust_pickle="yes")  # only the boolean true


def test_json_protocol_server_sees_the_images_brightness():
    def respond(path, body, n):
        req = json.loads(body)
        means = [float(_decode_jpeg(base64.b64decode(s)).mean()) for s in req["images"]]
        assert req["meta_datas"] == META and req["prompts"] == PROMPTS
        return 200, json.dumps({"scores": means}).encode()

    images = _images()
    with serve(respond) as (url, _):
        for reward in (build_reward("remote_json", url=url, **FAST),
                       build_reward("remote", url=url, format="json", **FAST)):
            scores = reward(images, PROMPTS, META)
            # The images' own means, as 8-bit pixels; JPEG (quality 95) on smooth images moves them < 0.01.
            expected = (images * 255).round().flatten(1).mean(1) / 255
            torch.testing.assert_close(scores, expected, atol=0.01, rtol=0)


def test_a_slow_server_is_retried_then_masked_with_the_attempts_counted(caplog):
    def slow(path, body, n):
        time.sleep(0.6)
        return 200, json.dumps({"scores": [1.0, 1.0, 1.0]}).encode()

    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"), serve(slow) as (url, received):
        t0 = time.perf_counter()
        reward = build_reward("remote_json", url=url, timeout=0.2, retries=2, backoff=0.05)
        scores = safe_score(reward, _images(), PROMPTS, META, name="remote_json")
        elapsed = time.perf_counter() - t0
        assert len(received) == 3  # 1 + retries attempts, and no per-sample retry of a dead server
    assert torch.isnan(scores).all() and elapsed < 2.0
    assert "failed 3 time(s)" in caplog.text and "timed out" in caplog.text


def test_a_server_failing_once_is_retried_into_scores():
    def flaky(path, body, n):
        return (500, b"busy") if n == 1 else (200, json.dumps({"scores": [0.1, 0.2, 0.3]}).encode())

    with serve(flaky) as (url, received):
        scores = build_reward("remote_json", url=url, timeout=2.0, retries=1, backoff=0.01)(_images(), PROMPTS)
        assert len(received) == 2
    torch.testing.assert_close(scores, torch.tensor([0.1, 0.2, 0.3]))


def test_an_unreachable_server_masks_the_batch(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with caplog.at_level(logging.WARNING, logger="megaflow.rewards"):
            scores = build_reward("remote_json", url=f"http://127.0.0.1:{port}", retries=1, backoff=0.01)(
                _images(), PROMPTS)
    assert torch.isnan(scores).all() and "failed 2 time(s)" in caplog.text


@contextlib.contextmanager
def raw_server(answer):
    """A loopback server that reads each request's head and then calls ``answer(connection)`` on its own
    thread (to send headers and bytes as slowly, or as much, as it likes); yields (url, requests seen)."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen, stop = [], threading.Event()

    def handle(conn):
        with conn:
            conn.settimeout(10)
            with contextlib.suppress(OSError):
                conn.recv(1 << 20)
                seen.append(1)
                answer(conn, stop)

    def accept():
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                threading.Thread(target=handle, args=(conn,), daemon=True).start()

    listener.settimeout(0.1)
    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stop.set()
        listener.close()


def test_a_server_that_never_answers_meets_the_deadline_and_is_reported_while_waiting(caplog, monkeypatch):
    """A request's total is bounded by ``deadline`` (not timeout x tries), and while it waits a warning says so."""
    from megaflow.rewards import remote

    monkeypatch.setattr(remote, "PROGRESS_S", 0.3)
    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"), \
            raw_server(lambda conn, stop: stop.wait(30)) as (url, _):
        t0 = time.perf_counter()
        scores = build_reward("remote_json", url=url, timeout=60, retries=2, deadline=1.5)(_images(), PROMPTS)
        elapsed = time.perf_counter() - t0
    assert torch.isnan(scores).all() and 1.4 <= elapsed < 4.0, elapsed
    assert "still waiting for " + url in caplog.text and "of the 1.5 s deadline" in caplog.text
    assert "failed 1 time(s)" in caplog.text  # the one attempt the deadline allowed


def _head(length: int | None) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + (b"Content-Length: %d\r\n" % length if length is not None else b"") + \
        b"Connection: close\r\n\r\n"


def test_an_answer_announced_over_the_cap_is_refused_unread_and_not_retried(caplog):
    def huge(conn, stop):
        conn.sendall(_head(1 << 30))
        while not stop.is_set():  # it would keep sending: the client must not wait for it
            conn.sendall(b"x" * 65536)

    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"), raw_server(huge) as (url, seen):
        t0 = time.perf_counter()
        scores = build_reward("remote_json", url=url, retries=2, backoff=0.01)(_images(), PROMPTS)
        assert time.perf_counter() - t0 < 5 and len(seen) == 1
    assert torch.isnan(scores).all() and "announces 1073741824 bytes, more than max_answer_bytes" in caplog.text


def test_an_unannounced_answer_is_cut_at_the_cap(caplog):
    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"), \
            raw_server(lambda conn, stop: conn.sendall(_head(None) + b"[" + b"1," * 600_000)) as (url, _):
        scores = build_reward("remote_json", url=url, max_answer_bytes=100_000, **FAST)(_images(), PROMPTS)
    assert torch.isnan(scores).all() and "more than max_answer_bytes = 100000 bytes" in caplog.text


def test_the_deadline_fires_while_bytes_keep_arriving(caplog):
    def trickle(conn, stop):
        conn.sendall(_head(10_000))
        while not stop.wait(0.05):
            conn.sendall(b" ")

    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"), raw_server(trickle) as (url, _):
        t0 = time.perf_counter()
        scores = build_reward("remote_json", url=url, timeout=5, retries=0, deadline=1.0)(_images(), PROMPTS)
        elapsed = time.perf_counter() - t0
    assert torch.isnan(scores).all() and 0.9 <= elapsed < 3.0, elapsed
    assert "still going at the deadline" in caplog.text


@pytest.mark.parametrize("answer", [{"scores": [1.0, 2.0]}, {"scores": [1.0, 2.0, 3.0, 4.0]}, {"nope": 1}, [1, 2, 3]])
def test_a_wrong_answer_masks_all_with_an_error(answer, caplog):
    with caplog.at_level(logging.ERROR, logger="megaflow.rewards"):
        with serve(lambda path, body, n: (200, json.dumps(answer).encode())) as (url, _):
            scores = build_reward("remote_json", url=url, **FAST)(_images(), PROMPTS)
    assert torch.isnan(scores).all()
    text = caplog.text
    assert url in text and (f"answered {len(answer['scores'])} scores for 3 samples" in text
                            if "scores" in answer else "cannot decode" in text)


def test_vlm_judge_against_a_fake_chat_completions_server():
    answers = {"a red circle": "0.8", "a gradient": "Yes.", "an orange square": "banana"}

    def respond(path, body, n):
        req = json.loads(body)
        text = req["messages"][0]["content"][1]["text"]
        prompt = text.split("'")[1]
        return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": answers[prompt]}}]}).encode()

    with serve(respond) as (url, received):
        reward = build_reward("vlm_judge", url=url, model="judge-7b", question="Is this '{prompt}'? Score 0-1.",
                              **FAST)
        scores = reward(_images(), PROMPTS, META)
    assert scores[:2].tolist() == pytest.approx([0.8, 1.0]) and math.isnan(scores[2])
    assert {path for path, _ in received} == {"/v1/chat/completions"} and len(received) == 3
    req = json.loads(received[0][1])
    assert req["model"] == "judge-7b" and req["temperature"] == 0
    image = req["messages"][0]["content"][0]["image_url"]["url"]
    assert image.startswith("data:image/jpeg;base64,")
    assert _decode_jpeg(base64.b64decode(image.split(",", 1)[1])).shape == (32, 32, 3)


def test_judge_rule():
    assert [judge_score(t) for t in ("yes", "No.", "**Yes**", "0.8", "Score: 1", ".5")] == [1, 0, 1, 0.8, 1, 0.5]
    assert judge_score("8/10", max_score=10) == 0.8
    for bad in ("1.5", "-0.2", "maybe", ""):
        with pytest.raises(ValueError):
            judge_score(bad)


def _cfg(name: str, kwargs: dict):
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in kwargs.items())
    return load_config(REPO / "configs" / "cpu_demo.toml",
                       [f"reward.weights={{{name} = 1.0}}", f"reward.kwargs={{{name} = {{{table}}}}}"])


@pytest.mark.parametrize("name, kwargs, key", [
    ("remote_json", {}, "reward.kwargs.remote_json.url"),
    ("vlm_judge", {"url": "127.0.0.1:8000", "model": "m"}, "reward.kwargs.vlm_judge.url"),
    ("remote", {"url": "http://127.0.0.1:1/"}, "reward.kwargs.remote.trust_pickle"),
    ("vlm_judge", {"url": "http://127.0.0.1:1/"}, "reward.kwargs.vlm_judge.model"),
])
def test_preflight_refuses_bad_server_kwargs_in_one_line(name, kwargs, key, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as e:
        pf.preflight(_cfg(name, kwargs), "show", files=False)
    assert str(e.value).startswith(key + ":") and "\n" not in str(e.value)


def test_preflight_probes_the_server_for_train_only(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = _cfg("remote_json", {"url": f"http://127.0.0.1:{s.getsockname()[1]}/score"})
        with pytest.raises(ConfigError, match=r"^reward.kwargs.remote_json.url: cannot reach 127.0.0.1:\d+"):
            pf.preflight(dead, "train")
        assert pf.preflight(dead, "show", files=False) is dead  # shown elsewhere: no probe
    with serve(lambda path, body, n: (200, b"{}")) as (url, _):
        alive = _cfg("remote", {"url": url, "trust_pickle": True})
        assert pf.preflight(alive, "train") is alive

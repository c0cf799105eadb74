"""`serve` on torchrun's own engine, in one launch: one server spanning two loopback nodes (two torchrun agents, c10d
rendezvous, rank 0 serving HTTP, one replica per node) with `--max-restarts 1`: its images are the job's; a rank
SIGKILLed while the server idles restarts the whole two-node group (every rank on both nodes a new process: the other
node's ranks leave with 1, told by rank 0 that a rank did not come, and its agent restarts them), which is ready again
after loading and gives the same image; then SIGTERM on every node drains it. Each assertion its own test."""

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import numpy as np
import psutil
import pytest
import rank_jobs
from PIL import Image
from torch.distributed import DistStoreError, HashStore

from neuron_diffusers.distributed import wait_keys
from neuron_diffusers.serve import liveness
from neuron_diffusers.serve.app import GENERATIONS
from neuron_diffusers.serve.liveness import Liveness
from neuron_diffusers.stopping import ExitWhenStuck

PEER_TIMEOUT_S = 8.0  # a loaded machine can stall a loading rank's heartbeat for seconds
#: torchrun's agent waits this long for its workers after its SIGTERM, then SIGKILLs them (torch's default).
TORCHRUN_CLOSE_S = 30.0
SERVE = ["-m", "neuron_diffusers", "serve", "--tp", "2", "--steps", "2", "--max-steps", "1000", "--timeout", "60",
         "--peer-timeout", str(PEER_TIMEOUT_S)]


#: Every probe's client. `httpx.get` builds a client, and its SSL context, per call (~25 ms of CPU): at a probe every
#: 20 ms that took most of a core from the servers being watched. No keep-alive: each request opens its own
#: connection, as a fresh `httpx.get` does.
PROBES = httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Agent:
    """One torchrun agent, its output lines kept with the second they came (since `started`)."""

    def __init__(self, *torchrun: str, port: int):
        command = [sys.executable, "-m", "torch.distributed.run", *torchrun, *SERVE, "--port", str(port)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.started = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))

    def log(self, last: int = 40) -> str:
        return "".join(line for _, line in self.lines[-last:])

    def ranks(self) -> dict[int, int]:
        """Global rank -> pid of this agent's workers."""
        workers = psutil.Process(self.process.pid).children()
        return {int(worker.environ()["RANK"]): worker.pid for worker in workers}

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _probe(url: str) -> tuple:
    """(/health status, its restarts or None, /ready status), or ("gone",) when nothing answers."""
    try:
        health = PROBES.get(url + "/health")
        ready = PROBES.get(url + "/ready")
    except httpx.HTTPError:
        return ("gone",)
    restarts = health.json().get("restarts") if health.status_code == 200 else None
    return health.status_code, restarts, ready.status_code


def _wait_ready(url: str, agents: list[Agent], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(agent.process.poll() is not None for agent in agents):
            raise AssertionError("an agent exited while starting:\n" + "".join(a.log() for a in agents))
        if _probe(url)[-1] == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the server was not ready in time:\n" + "".join(a.log() for a in agents))


def _image(client: httpx.Client, url: str, seed: int, steps: int = 2) -> np.ndarray:
    answer = client.post(url + GENERATIONS, json={"prompt": "a red fox", "seed": seed, "num_inference_steps": steps})
    assert answer.status_code == 200, answer.text
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))).convert("RGB"))


def _stop_ranks(agents: list[Agent]) -> None:
    """SIGTERM every rank of every agent, as torchrun (or Kubernetes, on each node) would."""
    for agent in agents:
        for pid in agent.ranks().values():
            os.kill(pid, signal.SIGTERM)


def _busy(url: str) -> None:
    deadline = time.monotonic() + 60
    while "neuron_diffusers_busy_replicas 1.0" not in PROBES.get(url + "/metrics", timeout=5).text:
        assert time.monotonic() < deadline, "no request became busy"
        time.sleep(0.05)


def _restart(url: str, agents: list[Agent]) -> dict:
    """SIGKILL rank 1 while the server idles; every probe's answer until the restarted group is ready (back to
    back)."""
    before = {rank: pid for agent in agents for rank, pid in agent.ranks().items()}
    holder = next(agent for agent in agents if 1 in agent.ranks())
    os.kill(before[1], signal.SIGKILL)
    killed, probes = time.monotonic(), []
    while time.monotonic() - killed < 240 and all(agent.process.poll() is None for agent in agents):
        probes.append((time.monotonic() - killed, _probe(url)))
        if probes[-1][1] == (200, 1, 200):
            break
        time.sleep(0.02)
    return {"killed": killed, "probes": probes, "holder": holder, "before": before}


def _drain(client: httpx.Client, url: str, agents: list[Agent]) -> dict:
    """A request in flight while every rank of every node gets SIGTERM: its answer, every agent's exit code."""
    in_flight = []
    sender = threading.Thread(target=lambda: in_flight.append(
        client.post(url + GENERATIONS, json={"prompt": "last fox", "num_inference_steps": 30})))
    sender.start()
    _busy(url)
    ranks = {rank: pid for agent in agents for rank, pid in agent.ranks().items()}
    _stop_ranks(agents)
    sender.join(120)
    return {"in_flight": in_flight, "ranks": ranks, "codes": [agent.process.wait(120) for agent in agents]}


@pytest.fixture(scope="module")
def served():
    """Two torchrun agents on loopback as two nodes of 2 ranks (tp=2 inside each, one replica per node, rank 0
    serving HTTP, `--max-restarts 1`): two requests at once (one per replica) and one more, rank 1 SIGKILLed while
    idle until the restarted group is ready, the first image again, then one in flight while every rank gets
    SIGTERM."""
    port, rendezvous = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    joined = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rendezvous}",
              "--rdzv-id=neuron-diffusers-serve-test", "--max-restarts=1"]
    agents = [Agent(*joined, port=port) for _ in range(2)]
    try:
        _wait_ready(url, agents)
        ready = httpx.get(url + "/ready").json()
        with httpx.Client(timeout=120) as client:
            answers = {}
            together = [threading.Thread(target=lambda s=s: answers.__setitem__(s, _image(client, url, 7)))
                        for s in ("a", "b")]
            for thread in together:
                thread.start()
            for thread in together:
                thread.join(300)
            answers[8] = _image(client, url, 8)
            first = _probe(url)
            restart = _restart(url, agents)
            after = _image(client, url, 7)
            drained = _drain(client, url, agents)
        return {"ready": ready, "answers": answers, "first": first, "after": after, "agents": agents,
                **restart, **drained}
    except Exception as error:  # with what every agent said (e.g. the restart that never came)
        logs = "\n=====\n".join(agent.log(200) for agent in agents)
        raise AssertionError(f"{error!r}\n{logs}") from error
    finally:
        for agent in agents:
            agent.kill()


@pytest.fixture(scope="module")
def job_images(tmp_path_factory, rank_pool):
    """The job's images for seeds 7 and 8 at TP=2 (its plan and run on 2 of the session's ranks)."""
    out, prompts = tmp_path_factory.mktemp("job"), tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompts.write_text("a red fox\na red fox\n")  # image i gets --seed + i
    rank_pool.run(rank_jobs._job_outputs, 2, ["--prompts", str(prompts), "--seed", "7", "--steps", "2", "--tp", "2",
                                              "--out", str(out)], timeout_s=300)
    return {seed: np.asarray(Image.open(next(out.glob(f"0000{index}-*.png"))).convert("RGB"))
            for index, seed in enumerate((7, 8))}


def test_two_nodes_serve_one_replica_per_node(served):
    assert sorted(served["ranks"]) == [0, 1, 2, 3]
    assert (served["ready"]["replicas"], served["ready"]["tp"]) == (2, 2), served["ready"]


def test_two_nodes_give_the_jobs_images(served, job_images):
    answers = served["answers"]
    assert np.array_equal(answers["a"], job_images[7]) and np.array_equal(answers["b"], job_images[7])
    assert np.array_equal(answers[8], job_images[8])
    assert not np.array_equal(answers[8], job_images[7])  # control: the comparison can fail


def test_a_rank_killed_while_idle_restarts_the_two_node_serving_group(served):
    probes = [probe for _, probe in served["probes"]]
    log = "".join(agent.log() for agent in served["agents"])
    assert served["first"] == (200, 0, 200)
    assert ("gone",) in probes, (probes[:5], log)  # the first group stopped: its HTTP server went away
    assert probes[-1] == (200, 1, 200), (probes[-5:], log)  # /health says the group was restarted once
    # Every rank on both nodes is a new process: the other node's agent restarted its ranks too.
    assert sorted(served["before"]) == sorted(served["ranks"]) == [0, 1, 2, 3], (served["before"], served["ranks"])
    assert not set(served["before"].values()) & set(served["ranks"].values()), (served["before"], served["ranks"])
    other = next(agent for agent in served["agents"] if agent is not served["holder"])
    print("the other node's agent:", [line.strip()[-100:] for _, line in other.lines if "exitcode" in line])


def test_the_restarted_group_is_ready_only_after_loading(served):
    probes = [probe for _, probe in served["probes"]]
    back = probes.index(next(probe for probe in probes if probe[0] == 200 and probe[1] == 1))
    # Listening again while the model loads: alive (/health 200), not ready (/ready 503), until the last probe.
    assert probes[back][2] == 503 and probes[-1][2] == 200, probes[back:]


def test_a_request_after_the_restart_gives_the_same_image(served):
    assert np.array_equal(served["after"], served["answers"]["a"])
    assert not np.array_equal(served["answers"][8], served["answers"]["a"])  # control: another seed's image differs


def test_rank_0_leaves_within_the_peer_timeout_not_torchruns_kill(served):
    """torchrun SIGTERMs rank 0 when rank 1 dies; rank 0 drains, and its wait for the dead rank ends by the
    heartbeats (--peer-timeout), before torchrun's own SIGKILL would end it. torchrun logs the dead rank once every
    worker of the group has stopped."""
    agent = served["holder"]
    stopped = next((when for when, line in agent.lines if "exitcode: -9" in line), None)
    assert stopped is not None, agent.log()
    seconds = stopped - served["killed"]
    print(f"the killed group stopped {seconds:.1f} s after the kill (--peer-timeout {PEER_TIMEOUT_S:g})")
    assert seconds < PEER_TIMEOUT_S + liveness.EXIT_GRACE_S + 10 < TORCHRUN_CLOSE_S, agent.log()


def test_sigterm_on_every_node_answers_the_request_in_flight(served):
    in_flight = served["in_flight"]
    assert len(in_flight) == 1 and in_flight[0].status_code == 200, in_flight


def test_sigterm_on_every_node_ends_every_rank_and_agent_with_0(served):
    # An agent exits 0 only when each of its workers did.
    assert served["codes"] == [0, 0], "".join(agent.log() for agent in served["agents"])


def test_leaving_together_ends_early_when_a_peer_dies(monkeypatch):
    """In one process: two ranks leave together (both True); then a rank that dies before it is done ends its
    peer's wait in about --peer-timeout (False), not at the wait's own timeout, and every rank leaves False."""
    monkeypatch.setattr(liveness, "BEAT_S", 0.02)
    monkeypatch.setattr(liveness, "EXIT_GRACE_S", 0.2)
    store, exits, results = HashStore(), [], {}
    pair = [Liveness(store, rank, 2, 0.3, exit_process=exits.append).start() for rank in (0, 1)]
    threads = [threading.Thread(target=lambda w=w: results.__setitem__(w.rank, w.leave_together(2, 30)))
               for w in pair]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == {0: True, 1: True} and not exits

    store = HashStore()
    alone = Liveness(store, 0, 2, 0.3, exit_process=exits.append).start()
    dead = Liveness(store, 1, 2, 0.3, exit_process=exits.append).start()
    time.sleep(0.1)
    dead._stop.set()  # rank 1 dies: no goodbye
    start = time.monotonic()
    assert alone.leave_together(2, 30) is False
    assert time.monotonic() - start < 5 and not exits and "rank 1 is gone" in alone.failure

    # Three ranks, rank 2 dies: rank 0's wait ends False, and rank 1, leaving after it, leaves False too (rank 0's word
    # is there when rank 1 first looks: no race with rank 1's own watch). Before, rank 0's word was "done" and rank 1
    # left True: it would exit 0, and on another node than the dead rank's its torchrun agent would end as finished.
    store, late_exits = HashStore(), []
    trio = [Liveness(store, rank, 3, 0.3, exit_process=late_exits.append).start() for rank in (0, 1, 2)]
    time.sleep(0.1)
    trio[2]._stop.set()
    assert trio[0].leave_together(3, 30) is False and "rank 2 is gone" in trio[0].failure
    assert trio[1].leave_together(3, 30) is False


class _Interrupted(Exception):
    pass


def test_a_signal_ends_a_wait_for_the_group_at_once():
    """torchrun SIGTERMs the ranks left when one dies; a rank waiting for the dead one in the entry handshake
    (`CallEntry`) or at the end (`leave_together`) must handle it at once, not when torchrun SIGKILLs it 30 s later.
    Control: a blocking store wait holds the signal's handler until the wait ends (the test can fail)."""
    store = HashStore()

    def interrupted_after(wait, seconds=0.2) -> float:
        """Seconds from arming a SIGALRM in `seconds` until its handler ran, while `wait()` runs."""
        ran, start = [], time.monotonic()

        def interrupt(signum, frame):
            ran.append(time.monotonic() - start)
            raise _Interrupted

        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            wait()
            time.sleep(5)  # the handler has run by now at the latest
        except _Interrupted:
            pass
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return ran[0]

    assert interrupted_after(lambda: wait_keys(store, ["never"], 30)) < 1.0
    # The control: the handler runs only once the blocking wait gives up (1 s), then raises.
    blocking = interrupted_after(lambda: _blocking_wait(store, 1.0))
    assert blocking >= 1.0, blocking


def _blocking_wait(store, seconds: float) -> None:
    try:
        store.wait(["never"], timedelta(seconds=seconds))
    except DistStoreError:
        pass


def test_a_job_stuck_in_one_call_after_sigterm_ends_after_the_grace():
    """The job's guard (`stopping.ExitWhenStuck`): a SIGTERM while the main thread is blocked in one call (as in a
    collective with a dead peer) ends the process `grace_s` later, though the Python handler has not run. Controls:
    no SIGTERM, no exit; a context left after the SIGTERM (the handler's `SystemExit`) cancels the exit."""
    exits, handled = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(time.monotonic()))
    try:
        with ExitWhenStuck(grace_s=0.3, exit_process=lambda code: exits.append((code, time.monotonic()))):
            _blocking_wait(HashStore(), 0.5)  # no signal: nothing happens
            start = time.monotonic()
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
            _blocking_wait(HashStore(), 2.0)  # blocked in one call: the handler waits for its end
        assert [code for code, _ in exits] == [128 + signal.SIGTERM]
        assert exits[0][1] - start < 1.5 < handled[0] - start, (exits, handled, start)

        exits.clear()
        with ExitWhenStuck(grace_s=0.5, exit_process=exits.append):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs; the job's would raise SystemExit and leave the context
        time.sleep(1.0)
        assert exits == []
    finally:
        signal.signal(signal.SIGTERM, previous)

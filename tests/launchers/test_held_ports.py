"""Held ports (primerl.launchers.HeldPort): a launcher binds each inference server's port before
anything starts and hands the socket to every start of the server (``--inference.listen_fd``),
so that two runs on one machine never pick the same port and a restarting server finds its
port still there. Real sockets, real ``primerl inference`` processes."""

import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import free_port, run_cli

from primerl.launchers import hold_ports, pick_ports
from primerl.rundir import RunDir
from primerl.supervisor import Child, Duty, Supervisor

HOST = "127.0.0.1"


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def refused(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.connect((HOST, port))
            return False
        except ConnectionRefusedError:
            return True


def test_a_held_port_is_not_picked_again_nor_bound_by_another_process():
    first = free_port()
    held = hold_ports(HOST, first, 2)
    try:
        assert held[0].port == first and len({h.port for h in held}) == 2
        assert not any(bindable(h.port) for h in held)
        again = hold_ports(HOST, first, 2)  # a second run asking for the same ports gets others
        try:
            assert not {h.port for h in again} & {h.port for h in held}
        finally:
            for h in again:
                h.close()
        assert first not in pick_ports(HOST, first, 1)  # the Slurm job's picker skips it too
    finally:
        for h in held:
            h.close()
    assert bindable(first)


def test_renewing_a_port_refuses_connections_until_the_next_server_and_keeps_the_port():
    (held,) = hold_ports(HOST, 0, 1)
    try:
        held.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as primerl.inference.listening does
        held.sock.listen()  # in the server it was handed to; the launcher shares the socket
        with socket.create_connection((HOST, held.port)):
            pass
        held.renew()  # the server exited
        assert refused(held.port) and not bindable(held.port)
    finally:
        held.close()


class _Said:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def tick(self) -> None:
        pass

    def note(self, line: str) -> None:
        self.notes.append(line)

    def stopping(self, outcome) -> None:
        pass


class _Cfg:
    class inference:
        max_restarts = 1

    class watchdog:
        stall_timeout_s = 0.0
        on_stall = "exit"


def test_the_supervisor_hands_each_start_of_a_server_its_held_socket(tmp_path):
    """Each start gets ``--inference.listen_fd``: the first one listens (as
    primerl.inference.listening does), answers once and exits; the restart finds the same port
    bound, past the connection the first one closed, and listens on it again; the trainer
    sees both answer."""
    run = RunDir(tmp_path / "run")
    run.logs.mkdir(parents=True)
    (held,) = hold_ports(HOST, 0, 1)
    serve = ("import socket, sys, time; s = socket.socket(fileno=int(sys.argv[sys.argv.index('--inference.listen_fd') "
             "+ 1])); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.listen(); c, _ = s.accept(); c.sendall(b'hi'); c.close(); sys.exit(9)")
    client = (f"import socket, time\nfor _ in range(2):\n    while True:\n        try:\n"
              f"            c = socket.create_connection(('{HOST}', {held.port})); break\n"
              f"        except ConnectionRefusedError:\n            time.sleep(0.05)\n"
              f"    assert c.recv(2) == b'hi', 'no answer'\n    c.close()\n    time.sleep(0.5)\n")
    kids = [Child(name="inference-0", duty=Duty.SERVES, command=(sys.executable, "-c", serve, "--inference.port",
                                                                 str(held.port)), log=run.log("inference-0"), held=held),
            Child(name="inference-1", duty=Duty.SERVES, command=(sys.executable, "-c", "import time; time.sleep(60)"),
                  log=run.log("inference-1")),
            Child(name="trainer", duty=Duty.FINISHES, command=(sys.executable, "-c", client), log=run.log("trainer"))]
    said = _Said()
    try:
        outcome = Supervisor(_Cfg, run, kids, said, grace=5).run()
    finally:
        held.close()
    assert outcome.code == 0, (outcome, run.log("trainer").read_text())
    assert "restarting it (1 of at most 1)" in said.notes[0], said.notes
    assert not any("cannot be restarted" in note for note in said.notes), said.notes


@pytest.mark.slow
def test_primerl_inference_serves_on_the_socket_it_is_handed():
    (held,) = hold_ports(HOST, 0, 1)
    cmd = [sys.executable, "-m", "primerl.cli", "inference", "--model", "glm5", "--inference.max_model_len", "256",
           "--host", HOST, "--port", str(held.port), "--inference.listen_fd", str(held.fd)]
    proc = subprocess.Popen(cmd, pass_fds=(held.fd,), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert not bindable(held.port)  # held while the model loads
            try:
                if httpx.get(f"http://{HOST}:{held.port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server never answered on the handed socket"
            time.sleep(0.3)
    finally:
        proc.kill()
        proc.wait()
        held.close()


@pytest.mark.slow
def test_a_listen_fd_that_is_no_socket_of_the_port_is_refused_in_one_line():
    r = run_cli("inference", "--model", "glm5", "--inference.listen_fd", "97", timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "inference.listen_fd 97 is not a socket this process inherited" in r.stderr, r.stderr
    with socket.socket() as other:
        other.bind((HOST, 0))
        fd = other.fileno()
        r = subprocess.run([sys.executable, "-m", "primerl.cli", "inference", "--model", "glm5", "--port", "8000",
                            "--inference.listen_fd", str(fd)], pass_fds=(fd,), capture_output=True, text=True,
                           timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"inference.listen_fd {fd} is not a TCP socket bound to inference.port 8000" in r.stderr, r.stderr

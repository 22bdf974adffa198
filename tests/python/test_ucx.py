"""Channels across hosts from Python: tshare.listen/connect on ucx://
addresses over 127.0.0.1, the token as an argument or from TSHARE_TOKEN.

  test_ucx.py TEST      (exit 0 pass, 1 fail, 77 skip with the reason)

Without UCX (libucp.so.0) the tests skip."""
import os
import sys
import threading

import harness  # noqa: F401  exits 77 without torch
import tshare

test = harness.Tests("test_ucx.py")
TOKEN = "py-shared-token"


def address():
    return "ucx://127.0.0.1:%d/weights" % (20000 + os.getpid() % 40000)


def listen_or_skip(where):
    try:
        return tshare.listen(where)
    except tshare.Error as e:
        if e.code == tshare.E_UNSUPPORTED:
            print("SKIP: %s" % e)
            sys.exit(77)
        raise


def ucx_pair(listener_token, connector_token, accept_timeout=10):
    """A listener's and a connector's channel of this process; the accept
    runs in a thread (each end's hello waits for the other's)."""
    where = address()
    l = listen_or_skip(where)
    out = {}

    def accept():
        try:
            out["ch"] = l.accept(timeout=accept_timeout, name="listener", token=listener_token)
        except tshare.Error as e:
            out["err"] = e

    th = threading.Thread(target=accept)
    th.start()
    try:
        c = tshare.connect(where, timeout=10, channel_name="connector", token=connector_token)
    finally:
        th.join(15)
        l.close()
    assert not th.is_alive(), "the accept did not end"
    if "err" in out:
        raise out["err"]
    return out["ch"], c


@test
def connect_and_accept_with_a_token_argument():
    os.environ.pop("TSHARE_TOKEN", None)
    a, b = ucx_pair(TOKEN, TOKEN)
    with a, b:
        assert a.transport == "ucx", a.transport
        assert b.transport == "ucx", b.transport
        assert a.receives_copies and b.receives_copies
        # A GPU tensor is staged only to a peer that says it can place it on a GPU.
        want = "staged" if os.path.exists("/dev/nvidiactl") else None
        assert a.gpu_path == want and b.gpu_path == want, (a.gpu_path, b.gpu_path, want)
        assert "over ucx" in repr(a), repr(a)
        assert a.peer_name == "connector" and b.peer_name == "listener", (a.peer_name, b.peer_name)
        b.close()  # the bye: the listener's receive sees the end
        assert tshare.recv(a, timeout=5) is None


@test
def the_token_comes_from_the_environment():
    os.environ["TSHARE_TOKEN"] = TOKEN
    a, b = ucx_pair(None, None)
    with a, b:
        assert a.transport == "ucx" and b.transport == "ucx"


@test
def a_wrong_or_missing_token_is_refused():
    os.environ.pop("TSHARE_TOKEN", None)
    try:
        tshare.connect(address(), timeout=1, token=None)
        raise AssertionError("a connect without a token was not refused")
    except tshare.Error as e:
        assert e.code == tshare.E_PERMISSION and "token" in str(e), e
    try:
        ucx_pair(TOKEN, "not-the-token", accept_timeout=2)
        raise AssertionError("a wrong token was accepted")
    except tshare.Error as e:
        assert e.code in (tshare.E_PERMISSION, tshare.E_TIMEOUT) and "token" in str(e), e


@test
def a_set_of_cpu_tensors_crosses_and_is_released_once_read():
    import torch

    os.environ.pop("TSHARE_TOKEN", None)
    a, b = ucx_pair(TOKEN, TOKEN)
    with a, b:
        base = tshare.empty_shared(290, 3, dtype=torch.float32)
        base += torch.arange(290, dtype=torch.float32).view(290, 1) + torch.arange(3.0)
        sent = {"t%d" % i: base[i] for i in range(290)}
        sent["w"] = tshare.share_memory_(torch.arange(64, dtype=torch.int64).view(8, 8).t().clone())
        out = {}

        def receive():
            out["r"] = tshare.recv(b, timeout=20)

        th = threading.Thread(target=receive)
        th.start()
        set_id = tshare.send(a, sent, meta=b"step=7", timeout=20)
        a.wait_released(set_id, timeout=20)  # released once read, while the consumer still holds it
        th.join(30)
        assert not th.is_alive(), "the receive did not end"
        r = out["r"]
        assert r.share_id == set_id and r.meta == b"step=7", r
        assert list(r.tensors) == list(sent), "names or order differ"
        for name, t in sent.items():
            assert torch.equal(r.tensors[name], t), name
        base.zero_()  # the producer's memory is its own again: the consumer's copy stays
        assert r.tensors["t5"].tolist() == [5.0, 6.0, 7.0], r.tensors["t5"]


@test
def a_cuda_state_dict_crosses_staged_through_host_memory():
    """GPU memory cannot be mapped on another host: its bytes are staged in
    host memory, read over UCX and placed on this end's GPU."""
    import torch

    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        sys.exit(77)
    os.environ.pop("TSHARE_TOKEN", None)
    a, b = ucx_pair(TOKEN, TOKEN)
    with a, b:
        torch.manual_seed(3)
        layers = [torch.nn.Linear(64, 64) for _ in range(144)] + [torch.nn.LayerNorm(64)]
        model = torch.nn.Sequential(*layers).cuda().to(torch.bfloat16)
        sent = model.state_dict()
        assert len(sent) == 290, len(sent)
        sent["strided"] = torch.arange(4096, device="cuda", dtype=torch.float32).view(64, 64).t()[3:, 5:]
        for round_ in range(2):
            out = {}

            def receive():
                try:
                    out["r"] = tshare.recv(b, timeout=30)
                except BaseException as e:  # noqa: B902  reported below
                    out["err"] = e

            th = threading.Thread(target=receive)
            th.start()
            set_id = tshare.send(a, sent, meta=b"round=%d" % round_, timeout=30)
            a.wait_released(set_id, timeout=30)  # released once read
            th.join(60)
            assert not th.is_alive(), "the receive did not end"
            if "err" in out:
                raise out["err"]
            r = out["r"]
            assert r.meta == b"round=%d" % round_, r.meta
            assert list(r.tensors) == list(sent), "names or order differ"
            for name, t in sent.items():
                got = r.tensors[name]
                assert got.device.type == "cuda", (name, got.device)
                assert got.dtype == t.dtype and got.shape == t.shape, (name, got.dtype, got.shape)
                assert torch.equal(got, t), name
            with torch.no_grad():  # in place, as a trainer's step does: the next round carries it
                for t in model.parameters():
                    t.add_(1)
            del r, out


if __name__ == "__main__":
    test.main()

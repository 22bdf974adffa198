"""CPU tensors in torch's own shared memory (Tensor.share_memory_(),
torch.multiprocessing) travel as that memory: no copy into a tshare memfd,
under both of torch's sharing strategies. One test per argument:

    test_torch_shm.py NAME
"""
import gc

import harness
from harness import memfds, pair

import torch
import torch.multiprocessing as tmp
import tshare

test = harness.Tests("test_torch_shm.py")

STRATEGIES = ("file_descriptor", "file_system")


def released(p, c, share_id):
    gc.collect()
    c.poll(0)  # the consumer's releases go out when it drives the channel
    p.wait_released(share_id, timeout=10)
    assert p.outstanding() == 0


def send_and_write_back(t):
    """Send t, write through the received tensor, and release it: the write
    must land in t itself (its memory travelled, not a copy)."""
    p, c = pair()
    before = memfds()
    share_id = tshare.send(p, t[2:6], move_to_shared_memory=False)
    assert memfds() == before, "a tshare memfd was made: the tensor was copied"
    r = tshare.recv(c, timeout=5)
    assert torch.equal(r.tensor, t[2:6])
    r.tensor.fill_(-1)
    assert t[2:6].eq(-1).all() and t[1] != -1 and t[6] != -1, t
    del r
    released(p, c, share_id)
    p.close()
    c.close()


@test
def share_memory_tensors_travel_as_their_own_memory():
    for strategy in STRATEGIES:
        tmp.set_sharing_strategy(strategy)
        t = torch.arange(32, dtype=torch.float32).share_memory_()
        ptr = t.data_ptr()
        assert t.is_shared() and tshare.is_shared(t)
        assert tshare.share_memory_(t) is t and t.data_ptr() == ptr  # already shared: left alone
        send_and_write_back(t)
        assert t.data_ptr() == ptr, strategy


@test
def the_share_keeps_the_storage_alive_after_the_tensor_went():
    for strategy in STRATEGIES:
        tmp.set_sharing_strategy(strategy)
        p, c = pair()
        t = torch.full((1000,), 3.5, dtype=torch.float64).share_memory_()
        share_id = tshare.send(p, t)
        del t
        gc.collect()
        r = tshare.recv(c, timeout=5)
        assert r.tensor.eq(3.5).all(), strategy
        del r
        released(p, c, share_id)


def _child_puts_shared_tensor(strategy, q, done):
    tmp.set_sharing_strategy(strategy)
    t = torch.arange(16, dtype=torch.int64)
    q.put(t)
    done.wait(30)


@test
def a_tensor_received_from_torch_multiprocessing_is_forwarded_as_its_memory():
    ctx = tmp.get_context("fork")
    for strategy in STRATEGIES:
        tmp.set_sharing_strategy(strategy)
        q, done = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=_child_puts_shared_tensor, args=(strategy, q, done))
        child.start()
        try:
            t = q.get(timeout=30)
            assert t.is_shared(), strategy
            send_and_write_back(t)
        finally:
            done.set()
            child.join(30)
        assert child.exitcode == 0, (strategy, child.exitcode)


@test
def a_state_dict_of_a_model_in_torch_shared_memory_goes_as_a_set_without_copy():
    for strategy in STRATEGIES:
        tmp.set_sharing_strategy(strategy)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        model.share_memory()
        p, c = pair()
        before = memfds()
        set_id = tshare.send(p, model.state_dict(), meta="v1")
        assert memfds() == before, "a tshare memfd was made: the set was copied"
        r = tshare.recv(c, timeout=5)
        assert r.meta == b"v1" and list(r.tensors) == list(model.state_dict())
        for name, t in model.state_dict().items():
            assert torch.equal(r.tensors[name], t), name
        with torch.no_grad():
            r.tensors["0.weight"].fill_(2.5)
            model[1].bias.fill_(-4.0)  # the producer's in-place update, seen by the consumer
        assert model[0].weight.eq(2.5).all(), strategy
        assert r.tensors["1.bias"].eq(-4.0).all(), strategy
        del r
        released(p, c, set_id)
        p.close()
        c.close()


if __name__ == "__main__":
    test.main()

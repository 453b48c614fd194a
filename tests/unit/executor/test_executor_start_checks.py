"""What the executor checks before it loads anything: a mistake is a message naming the flag."""

from __future__ import annotations

import pytest
import torch

from executor_svc.config import parse_config, require_device

MODEL = "m"  # (not read by these checks)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "tcp://127.0.0.1",
                                      "tcp://:5556", "tcp://127.0.0.1:55x", "udp://127.0.0.1:5556", "ipc://"])
def test_a_scheduler_endpoint_of_the_wrong_form_is_refused(endpoint, capsys):
    """tcp://127.0.0.1:99999 was accepted and dialled forever."""
    with pytest.raises(SystemExit) as e:
        parse_config(["--model", MODEL, "--scheduler", endpoint], {})
    assert e.value.code == 2
    assert "argument --scheduler: expected tcp://HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5556", "tcp://[::1]:65535", "tcp://sched.local:1",
                                      "ipc:///tmp/pagedserve/core-0"])
def test_a_scheduler_endpoint_of_the_right_form_is_kept(endpoint):
    assert parse_config(["--model", MODEL, "--scheduler", endpoint], {}).scheduler == endpoint


def test_device_cuda_without_cuda_is_refused_naming_the_flag(monkeypatch):
    """It failed deep in loading: AssertionError: Torch not compiled with CUDA enabled."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = parse_config(["--model", MODEL, "--scheduler", "tcp://127.0.0.1:5556", "--device", "cuda"], {})
    with pytest.raises(SystemExit) as e:
        require_device(cfg)
    assert str(e.value).startswith("pagedserve-executor: --device cuda: CUDA is not available to this process (")
    assert str(e.value).endswith("); use --device cpu")
    require_device(parse_config(["--model", MODEL, "--scheduler", "tcp://127.0.0.1:5556"], {}))  # cpu: nothing

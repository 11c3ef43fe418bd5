"""``python -m btlib.serve``'s values checked at start (issue 49, finding 8 and part of 11), each test failing on e398218.

Every value is checked before the model loads: one line naming the flag on stderr and exit status 2, as argparse
says a value of the wrong type. Was: ``--port 99999`` and ``--threads -1`` were tracebacks once the model had loaded,
``--max-inputs 0`` a server that answered 413 to every request. load_pretrained is replaced by a failure, so a check
that comes after the model loads fails the test.
"""

import socket
import subprocess
import sys

import pytest

from btlib.serve.extras import missing

pytestmark = pytest.mark.skipif(missing("fastapi", "serve") is not None, reason=str(missing("fastapi", "serve")))

TESTED_HERE = ["btlib.serve.__main__"]


@pytest.mark.parametrize("argv, match", [
    (["--port", "99999"], "argument --port: port must be a TCP port, 0 to 65535"),
    (["--port", "-1"], "argument --port"),
    (["--threads", "-1"], "argument --threads: threads must be an int > 0; got -1"),
    (["--threads", "0"], "argument --threads"),
    (["--max-inputs", "0"], "argument --max-inputs: max_inputs must be an int > 0"),
    (["--max-inputs", "-3"], "argument --max-inputs"),
    (["--max-inputs", "2000"], "exceeds --max-queue 1024"),
    (["--max-batch-tokens", "0"], "argument --max-batch-tokens"),
    (["--max-queue", "0"], "argument --max-queue"),
    (["--max-wait-ms", "nan"], "argument --max-wait-ms"),
    (["--max-wait-s", "0"], "argument --max-wait-s: max_wait_s must be a finite number > 0"),
    (["--max-wait-s", "inf"], "argument --max-wait-s"),
    (["--keep-warm-ms", "inf"], "argument --keep-warm-ms"),
    (["--payload-limit", "0"], "argument --payload-limit"),
    (["--answer-limit", "-1"], "argument --answer-limit"),
    (["--long-inputs", "chunk", "--chunk-overlap", "-1"], "argument --chunk-overlap"),
    (["--chunk-overlap", "4"], "applies to --long-inputs chunk only"),
    (["--auto-truncate", "--long-inputs", "chunk"], "auto_truncate=True is long_inputs='truncate'"),
    (["--model", "/no/such/folder"], "is not a folder"),
    (["--allowed-host", "two words"], "argument --allowed-host"),
    (["--api-key", ""], "the API key is empty"),
    (["--host", "999.1.1.1"], "cannot bind 999.1.1.1:0"),
])
def test_every_cli_value_is_checked_before_the_model_loads(argv, match, monkeypatch, capsys):
    """Was: --port 99999 and --threads -1 were tracebacks after the model loaded; --max-inputs 0 a server that
    answered 413 to every request."""
    import btlib.pretrained
    from btlib.serve.__main__ import main

    def loaded(*a, **kw):
        raise AssertionError("the model loaded before the values were checked")

    monkeypatch.setattr(btlib.pretrained, "load_pretrained", loaded)
    monkeypatch.delenv("BTLIB_API_KEY", raising=False)
    assert main(["--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m btlib.serve: ") and err.count("\n") == 1 and match in err, err


def test_a_port_in_use_is_said_before_the_model_loads(monkeypatch, capsys):
    import btlib.pretrained
    from btlib.serve.__main__ import main

    monkeypatch.setattr(btlib.pretrained, "load_pretrained", lambda *a, **kw: pytest.fail("the model loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot bind 127.0.0.1:{port}" in err and err.count("\n") == 1, err


def test_python_m_btlib_serve_says_a_bad_port_in_one_line_and_exits_2():
    p = subprocess.run([sys.executable, "-m", "btlib.serve", "--port", "99999", "--threads", "-1"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert "argument --port" in p.stderr

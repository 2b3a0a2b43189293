"""The stage bench's command line: bad arguments are one-line errors before any GPU work."""

from __future__ import annotations

import pytest

from tunedb.bench.stages import main


@pytest.mark.parametrize("args, needle", [
    (["--peers=torch_compile,bogus"], "--peers names one of"),
    (["--oracle=some"], "--oracle must be"),
])
def test_bad_arguments_are_refused_with_one_line(tmp_path, capsys, args, needle):
    out = tmp_path / "out.json"
    assert main([str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
    assert not out.exists()

"""The test harness itself: a failure pytest cannot point at a line of is still reported as that test's failure."""

import shutil
import subprocess
import sys
from pathlib import Path

# An exception whose first traceback entry has no line number, as a signal (pytest-timeout's) landing on an
# instruction without a line gives on Python 3.11: lasti past the code, so the line is unknown.
NO_LINE = '''
import sys, types

def test_fails_where_no_line_is():
    raise ValueError("boom").with_traceback(types.TracebackType(None, sys._getframe(), 10**6, -1))

def test_runs_after_it():
    pass
'''


def test_a_traceback_without_a_line_fails_its_test_not_the_session(tmp_path):
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_no_line.py").write_text(NO_LINE)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "INTERNALERROR" not in out.stdout + out.stderr, out.stdout[-3000:]
    assert "1 failed, 1 passed" in out.stdout and "ValueError: boom" in out.stdout, out.stdout[-3000:]

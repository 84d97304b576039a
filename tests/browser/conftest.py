"""JupyterLab driven by a real Chromium (Debian's chromium, through playwright): the page a learner sees.

One JupyterLab and one Chromium serve every browser test of the session (``browsing``,
tests/_browser.py). make test runs the quick ones; make check the exercise runs of labs 11 and 12.
"""
import pytest


@pytest.fixture(scope="session")
def browsing(tmp_path_factory):
    """One JupyterLab and one Chromium for every browser test of the session (tests/_browser.py)."""
    from _browser import open_browsing

    with open_browsing(tmp_path_factory) as shared:
        yield shared

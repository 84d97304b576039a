"""make handouts: a notebook executed on a real kernel becomes a static page that keeps its figure."""
import nbformat
import pytest

from ddplab.course import handouts

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def _notebook(path, *cells):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_a_handout_keeps_its_plotly_figure_and_a_failing_notebook_is_named(tmp_path, capsys):
    good = _notebook(tmp_path / "good.ipynb",
                     "import plotly.graph_objects as go\n"
                     "go.Figure(go.Bar(x=['manual', 'bucketed'], y=[67.7, 54.7]))")
    bad = _notebook(tmp_path / "bad.ipynb", "print('before')", "assert 1 == 2, 'the check failed'")
    code = handouts.main([str(good), str(bad), "-o", str(tmp_path / "out")])
    assert code == 1
    page = (tmp_path / "out" / "good.html").read_text()
    assert "plotly.js v" in page and '"bucketed"' in page  # plotly.js embedded: opens offline
    failed = (tmp_path / "out" / "bad.html").read_text()
    assert "before" in failed and "the check failed" in failed
    index = (tmp_path / "out" / "index.html").read_text()
    assert "good.html" in index and "failed: " in index
    assert "FAILED: " in capsys.readouterr().out

"""The HTML inspection report and the ``leancompile explain`` command."""
import html
import re
import shutil
import xml.etree.ElementTree as ET

import pytest

from leancompile import cli, drawing, report
from leancompile.tasks import synthetic
from leancompile.passes.meta import CALL, SHARED
from leancompile.passes.rewrite import REUSED, RETAINED
from leancompile.runtime import rowwise


@pytest.fixture(scope="module")
def retain():
    # Traced graphs are shared across backbones of one program (runtime.rowwise): start without those of earlier
    # tests in this process, so that this trainer's history records the traced-rows pipeline
    rowwise._TRACES.clear()
    trainer = synthetic.optimized_tiny_trainer("sd3", schedule="retain")
    trainer.step(list(synthetic.TINY_PROMPTS))  # adds the partition graphs
    return trainer


def _svgs(page: str) -> list[str]:
    return re.findall(r"<svg\b.*?</svg>", page, re.S)


def _check_page(trainer, page: str) -> None:
    assert "Legend" in page and all(html.escape(text) in page for *_, text in report.ROLES.values())
    for action in trainer.plan.steps:
        assert f"<tr><td>{action.step}</td><td>{action.label}</td>" in page
    svgs = _svgs(page)
    assert len(svgs) == len(trainer.graphs)
    for svg in svgs:
        ET.fromstring(svg)  # well-formed on its own
    assert "<link" not in page and "src=" not in page  # self-contained


def test_summary_counts_the_rewrite(retain):
    counts = report.summary(retain)
    assert set(counts) == {"rollout", "update", "rollout_traced", "update_traced", "backbone_forward",
                           "backbone_backward"}
    assert counts["update"]["names"]["reused"] == [REUSED]
    assert counts["rollout"]["names"]["inserted"] == [RETAINED]
    kept = {n.name for n in retain.graphs["update"].graph.nodes}
    vanished = [n.name for n in retain.graphs["update_traced"].graph.nodes if SHARED in n.meta and n.name not in kept]
    assert counts["update_traced"]["removed"] == len(vanished) > 0
    assert counts["update_traced"]["names"]["removed"] == vanished
    assert counts["update"]["backbone"] == 0
    assert counts["rollout_traced"]["backbone"] == sum(CALL in n.meta for n in retain.graphs["rollout_traced"].graph.nodes)


def test_call_regions_collapse_into_one_box(retain):
    gm = retain.graphs["rollout_traced"]
    boxes, edges = drawing.graph_boxes(gm, report.node_roles(retain.graphs, "rollout_traced"))
    calls = [b for b in boxes if b.role == "backbone"]
    assert len(calls) == 1 and calls[0].lines[0] == "backbone call 0 (backbone)"
    assert "676 aten nodes" in calls[0].lines[1] and "134 parameters" in calls[0].lines[3]
    assert len(boxes) < len(gm.graph.nodes) / 8
    assert all(a != b for a, b in edges)


def test_html_report_in_pure_python(retain, tmp_path):
    path = report.write_html_report(retain, tmp_path / "report.html", layout="python")
    page = path.read_text()
    _check_page(retain, page)
    assert REUSED in page and RETAINED in page
    assert "removed by the rewrite" in page


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_html_report_with_graphviz(retain, tmp_path):
    page = report.write_html_report(retain, tmp_path / "report.html", layout="dot").read_text()
    _check_page(retain, page)
    assert report.ROLES["reused"][0] in page and report.ROLES["removed"][0] in page


def test_the_native_schedule_inserts_and_removes_nothing(tmp_path):
    trainer = synthetic.optimized_tiny_trainer("sd3", schedule="native")
    counts = report.summary(trainer)
    assert set(counts) == {"rollout", "update"}
    assert all(c[role] == 0 for c in counts.values() for role in report.HIGHLIGHTED)
    page = report.write_html_report(trainer, tmp_path / "report.html").read_text()
    _check_page(trainer, page)
    drawings = "".join(_svgs(page))
    assert not any(report.ROLES[role][0] in drawings for role in report.HIGHLIGHTED)


def test_tiny_report_command_prints_the_plan_and_writes_the_report(tmp_path, capsys):
    assert cli.main(["tiny-report", "--schedule", "reweight", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "leancompile plan: schedule=reweight (requested reweight)" in printed and "reuse:" in printed
    page = (tmp_path / "report.html").read_text()
    # rollout with the provisional backward collapsed into one box, update, traced rollout, the per-row backbone's
    # forward and backward
    assert len(_svgs(page)) == 5 and "provisional backward (Reweight)" in page


def test_the_pass_history_lists_every_pass_in_order_with_what_it_changed(retain, tmp_path):
    """Compile-time analyses first, then the pipelines of the per-row program (partition, then traced rows); each
    rewrite's node counts add up, and the explanation and the HTML page show the history."""
    from leancompile.passes import ONE_ROW_PARTITION, TRACED_ROWS

    records = retain.pass_history.records
    names = [r.name for r in records]
    assert names[:6] == ["capture", "detect_shared_backbone", "check_validity", "check_linearity",
                         "prune_gradient_need", "rewrite_for_retain"]
    partition = [p.name for p in ONE_ROW_PARTITION]
    assert names[6:6 + 2 * len(partition)] == partition * 2
    traced = [r for r in records if r.graph.startswith(("forward over", "backward over"))]
    assert traced and {r.name for r in traced} <= {p.name for p in TRACED_ROWS}
    assert "write_scatters_in_place" not in {r.name for r in traced if r.graph.startswith("backward")}
    for r in records[6:]:
        assert r.seconds >= 0 and (r.changed > 0 or r.nodes[0] == r.nodes[1])
    assert any(r.name == "fold_views" and r.nodes[1] < r.nodes[0] for r in traced)
    assert "passes (in the order they ran):" in retain.explain()
    page = report.write_html_report(retain, tmp_path / "report.html").read_text()
    assert "<h2>Passes</h2>" in page and "<td>fold_views</td>" in page


def test_a_failing_pass_is_named_with_its_graph():
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from leancompile.passes.pipeline import Pass, PassError, apply

    def breaks(gm):
        raise RuntimeError("cannot rewrite this")

    gm = make_fx(lambda x: x.exp())(torch.ones(2))
    with pytest.raises(PassError, match="pass breaks on one-row forward: RuntimeError: cannot rewrite this"):
        apply(Pass(breaks), gm, "one-row forward")

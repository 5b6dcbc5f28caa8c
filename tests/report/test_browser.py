"""The report in a real browser: headless Chromium driven by Playwright.

Needs Debian's ``chromium`` (``make install`` installs it where apt can) and
the ``playwright`` package (the ``test`` extra); skips, saying which is
missing, elsewhere. ``STEPFX_SCREENSHOT_DIR`` keeps the screenshots.
"""
import contextlib
import os
import shutil

import pytest

pytest.importorskip("matplotlib", reason="the report's plots need matplotlib (the 'report' extra)")
playwright = pytest.importorskip("playwright.sync_api", reason="no playwright (pip install playwright)")

CHROMIUM = os.environ.get("STEPFX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian: apt-get install chromium; or set STEPFX_CHROMIUM)"),
]


def _not_blank(path) -> bool:
    from PIL import Image  # matplotlib's own dependency

    with Image.open(path) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1 << 16)
    return colors is None or len(colors) > 20  # None: more colors than counted


def _shots_dir(tmp_path) -> str:
    shots = os.environ.get("STEPFX_SCREENSHOT_DIR") or str(tmp_path)
    os.makedirs(shots, exist_ok=True)
    return shots


@contextlib.contextmanager
def _page(path: str, errors: list):
    """The page at ``path`` in headless Chromium; console errors and page errors go to ``errors``."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"file://{path}")
            yield page
        finally:
            browser.close()


def test_the_report_in_chromium(mlp_step, tmp_path):
    path = mlp_step.report(str(tmp_path / "report.html"))
    shots = _shots_dir(tmp_path)
    errors = []
    with _page(path, errors) as page:
        for section in ("passes", "program", "timeline", "memory", "communication"):
            assert page.locator(f"#r0-{section}").is_visible()
        # a pass's diff opens on a click
        diff = page.locator("details.pass").first
        assert diff.get_attribute("open") is None and not diff.locator("table.diff").is_visible()
        diff.locator("summary").click()
        assert diff.get_attribute("open") is not None and diff.locator("table.diff").is_visible()
        # the search box filters the program's rows
        rows = page.locator("#r0-program-table tbody tr")
        total = rows.count()
        page.fill("#r0-program-search", "addmm")
        shown = page.locator("#r0-program-table tbody tr:not([hidden])")
        assert 0 < shown.count() < total
        assert all("addmm" in t for t in shown.all_inner_texts())
        assert page.locator("#r0-program-count").inner_text() == f"{shown.count()} of {total} nodes"
        # pictures drawn: non-blank screenshots of the page and of the memory plot
        page.screenshot(path=os.path.join(shots, "report_top.png"))
        page.locator("#r0-memory figure").screenshot(path=os.path.join(shots, "report_memory.png"))
        page.locator("#r0-timeline").screenshot(path=os.path.join(shots, "report_timeline.png"))
    assert not errors, errors
    for name in ("report_top.png", "report_memory.png", "report_timeline.png"):
        assert _not_blank(os.path.join(shots, name)), name


def _bf16_codegen_report(path: str) -> str:
    """A bf16 plan with stepfx's kernels (Triton's interpreter on the CPU)."""
    import torch

    import stepfx
    from tests.steps import lm_step, tiny_gpt, token_batches

    torch.manual_seed(0)
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = stepfx.parallelize({"bf16": {"enabled": True}, "gradient_clipping": 1.0, "stepfx": {"codegen": True}})(lm_step)
    for (b,) in token_batches(2):
        step(model, opt, b)
    return step.report(path)


@pytest.mark.parametrize("kind", ["zero3_two_ranks", "bf16_codegen"])
def test_the_demo_s_zero3_on_two_ranks_and_a_bf16_codegen_plan_in_chromium(rank_pool, tmp_path, kind):
    """The page of the demo's set-up (a GPT under ZeRO-3, both ranks in one page) and of a bf16
    plan with stepfx's kernels: every rank's sections visible, no console errors, non-blank plots."""
    path = str(tmp_path / f"{kind}.html")
    if kind == "zero3_two_ranks":
        from tests.report.report_workers import zero3_gpt_report

        assert rank_pool(2).run(zero3_gpt_report, path, timeout=300)[0] == path
        ranks = (0, 1)
    else:
        _bf16_codegen_report(path)
        ranks = (0,)
    shots = _shots_dir(tmp_path)
    errors = []
    with _page(path, errors) as page:
        for rank in ranks:
            for section in ("passes", "program", "timeline", "memory", "communication"):
                page.locator(f"#r{rank}-{section}").scroll_into_view_if_needed()
                assert page.locator(f"#r{rank}-{section}").is_visible(), (rank, section)
            page.locator(f"#r{rank}-memory figure").screenshot(path=os.path.join(shots, f"{kind}_r{rank}_memory.png"))
            page.locator(f"#r{rank}-timeline").screenshot(path=os.path.join(shots, f"{kind}_r{rank}_timeline.png"))
        if kind == "bf16_codegen":  # the fused kernels are in the program
            page.fill("#r0-program-search", "stepfx")
            assert page.locator("#r0-program-table tbody tr:not([hidden])").count() > 0
    assert not errors, errors
    for rank in ranks:
        for what in ("memory", "timeline"):
            assert _not_blank(os.path.join(shots, f"{kind}_r{rank}_{what}.png")), (rank, what)

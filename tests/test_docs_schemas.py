"""docs/backends.md and extensions/csrc/README.md describe the ops ops.cpp defines: every schema string of
TORCH_LIBRARY(approx) appears in docs/backends.md verbatim (whitespace aside), and no other approx:: schema
is listed there; the kernels' README names every op."""
import re

from tests.conftest import REPO


def cpp_schemas() -> list[str]:
    cpp = (REPO / "extensions" / "csrc" / "ops.cpp").read_text()
    block = cpp[cpp.index("TORCH_LIBRARY(approx, m)"):]
    return ["".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1))).replace('\\"', '"')
            for m in re.finditer(r'm\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)[,)]', block)]  # `, impl)`: a def with its kernel


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("( ", "(")


def documented_schemas(doc: str) -> list[str]:
    """approx::name(...) -> ... entries of the doc's first code block, joined across their wrapped lines."""
    block = doc.split("```", 2)[1]
    return [_flat(e).strip() for e in re.split(r"\n(?=approx::)", block.strip()) if e.startswith("approx::")]


def test_ops_cpp_schemas_are_found():
    names = [s.split("(", 1)[0] for s in cpp_schemas()]
    assert {"lut_linear", "lut_conv2d", "quantize", "dequantize", "requantize", "lut_grad_a", "lut_grad_w"} <= set(names)


def test_backends_doc_lists_the_schemas_of_ops_cpp():
    documented = documented_schemas((REPO / "docs" / "backends.md").read_text())
    assert documented == [f"approx::{_flat(s)}" for s in cpp_schemas()]


def test_kernels_readme_names_every_op():
    readme = (REPO / "extensions" / "csrc" / "README.md").read_text()
    missing = [s.split("(", 1)[0] for s in cpp_schemas() if not re.search(rf"\b{s.split('(', 1)[0]}\b", readme)]
    assert not missing

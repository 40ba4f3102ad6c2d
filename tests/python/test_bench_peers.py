"""bench/peers.py without a GPU: the --triton-kernels argument, the checks of the triton_kernels package it
points to (a stand-in package written here, since triton_kernels is never vendored) and what the table says
when the row cannot run."""

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("fp4moe_bench_peers", ROOT / "bench" / "peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def clean_imports():
    """Each test imports its own stand-in triton_kernels: drop it (and the sys.path entry) afterwards."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name in [n for n in sys.modules if n == "triton_kernels" or n.startswith("triton_kernels.")]:
        del sys.modules[name]


def write_package(root, peers, omit_module=None, omit_attr=None, weight_scale=True, reduction_n=True):
    """A stand-in triton_kernels under root/triton_kernels that defines every name the row checks, less
    omit_module (a module) or omit_attr ((module, name))."""
    pkg = root / "triton_kernels"
    modules = {}
    for mod, attr in peers.TRITON_KERNELS_NEEDS:
        modules.setdefault(mod, []).append(attr)
    for mod, attrs in modules.items():
        if mod == omit_module:
            continue
        rel = Path(*mod.split(".")[1:]).with_suffix(".py")
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in [path.parent, *path.parent.parents]:
            if d == pkg.parent:
                break
            (d / "__init__.py").touch()
        lines = ["import dataclasses"]
        for attr in attrs:
            if (mod, attr) == omit_attr:
                continue
            if attr == "PrecisionConfig":
                field = "weight_scale" if weight_scale else "b_mx_scale"
                lines.append(f"@dataclasses.dataclass\nclass PrecisionConfig:\n    {field}: object = None")
            elif attr == "FnSpecs":
                extra = ", reduction_n=1" if reduction_n else ""
                lines.append(f"class FnSpecs:\n    def __init__(self, name, fn, fn_arg_names{extra}):\n        pass")
            else:
                lines.append(f"{attr} = object()")
        path.write_text("\n".join(lines) + "\n")
    (pkg / "__init__.py").touch()
    return root


def test_without_the_option_the_row_is_off(peers):
    a = peers.parse_args(["--models", "gpt-oss-20b,gpt-oss-120b", "--mode", "w4a16"])
    assert a.triton_kernels is None
    assert a.all_peers == ["torch_bf16", "torch_fp8"]
    doc = peers.triton_kernels_doc(a)
    assert doc["requested"] is False
    assert "no --triton-kernels PATH" in peers.triton_table_note(doc)


def test_the_option_adds_the_row(peers, tmp_path):
    write_package(tmp_path, peers)
    a = peers.parse_args(["--models", "gpt-oss-20b,qwen3-30b-a3b", "--mode", "w4a16", "--triton-kernels",
                          str(tmp_path)])
    assert a.all_peers == ["torch_bf16", "torch_fp8", "triton_mxfp4"]
    doc = peers.triton_kernels_doc(a)
    assert doc["models"] == ["gpt-oss-20b"]  # only the gpt-oss presets: swiglu_oai, renormalize
    assert "v3.6.0" in doc["expected"]


def test_mxfp4_presets_need_mode_w4a16(peers, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--models", "gpt-oss-20b,qwen3-30b-a3b"])  # default mode w4a4_scalar
    assert "MXFP4 presets run in fp4moe's mode w4a16 only" in capsys.readouterr().err
    assert peers.parse_args(["--models", "gpt-oss-20b", "--mode", "w4a16"]).mode == "w4a16"
    assert peers.parse_args(["--models", "gpt-oss-20b", "--no-fp4moe"]).no_fp4moe  # the peers alone


def test_presets_of_gpt_oss(peers):
    for m, E in (("gpt-oss-120b", 128), ("gpt-oss-20b", 32)):
        p = peers.PRESETS[m]
        assert (p["E"], p["H"], p["I"], p["k"]) == (E, 2880, 2880, 4)
        assert (p["alpha"], p["limit"], p["beta"]) == (1.702, 7.0, 1.0)
        assert peers.triton_applies(p)
    assert not peers.triton_applies(peers.PRESETS["deepseek-r1"])


@pytest.mark.parametrize("bad", ["", "does-not-exist"])
def test_a_path_that_is_no_folder_is_an_argument_error(peers, tmp_path, capsys, bad):
    path = bad if not bad else str(tmp_path / bad)
    with pytest.raises(SystemExit) as e:
        peers.parse_args(["--triton-kernels", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--triton-kernels" in err and "v3.6.0" in err


def test_a_folder_without_the_package(peers, tmp_path, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--triton-kernels", str(tmp_path)])
    assert "no triton_kernels/__init__.py" in capsys.readouterr().err


def test_the_package_folder_itself_gets_a_hint(peers, tmp_path):
    write_package(tmp_path, peers)
    with pytest.raises(peers.TritonKernelsError, match="pass its parent"):
        peers.check_triton_kernels_path(tmp_path / "triton_kernels")


def test_the_triton_peer_is_not_a_peers_name(peers, capsys):
    with pytest.raises(SystemExit):
        peers.parse_args(["--peers", "triton_mxfp4"])
    assert "--triton-kernels PATH" in capsys.readouterr().err


def test_a_complete_package_loads(peers, tmp_path, clean_imports):
    write_package(tmp_path, peers)
    tk = peers.load_triton_kernels(str(tmp_path))
    for _mod, attr in peers.TRITON_KERNELS_NEEDS:
        assert hasattr(tk, attr), attr
    assert tk.path == str(tmp_path.resolve())


def test_a_missing_module_is_named(peers, tmp_path, clean_imports):
    write_package(tmp_path, peers, omit_module="triton_kernels.matmul_ogs")
    with pytest.raises(peers.TritonKernelsError) as e:
        peers.load_triton_kernels(str(tmp_path))
    msg = str(e.value)
    assert "missing module triton_kernels.matmul_ogs" in msg
    assert "triton v3.6.0" in msg


def test_a_missing_name_is_named(peers, tmp_path, clean_imports):
    write_package(tmp_path, peers, omit_attr=("triton_kernels.tensor", "SparseMatrix"))
    with pytest.raises(peers.TritonKernelsError) as e:
        peers.load_triton_kernels(str(tmp_path))
    assert "missing triton_kernels.tensor.SparseMatrix" in str(e.value)
    assert "triton v3.6.0" in str(e.value)


def test_a_later_precision_config_is_named(peers, tmp_path, clean_imports):
    write_package(tmp_path, peers, weight_scale=False)
    with pytest.raises(peers.TritonKernelsError, match=r"PrecisionConfig\.weight_scale.*v3\.6\.0"):
        peers.load_triton_kernels(str(tmp_path))


def test_an_earlier_fn_specs_is_named(peers, tmp_path, clean_imports):
    write_package(tmp_path, peers, reduction_n=False)
    with pytest.raises(peers.TritonKernelsError, match=r"FnSpecs\(reduction_n=\)"):
        peers.load_triton_kernels(str(tmp_path))


def test_an_import_error_inside_the_package_is_reported(peers, tmp_path, clean_imports):
    write_package(tmp_path, peers)
    (tmp_path / "triton_kernels" / "topk.py").write_text("import a_module_that_is_not_installed\ntopk = 1\n")
    with pytest.raises(peers.TritonKernelsError, match="importing triton_kernels.topk failed.*a_module_that_is_not"):
        peers.load_triton_kernels(str(tmp_path))


def test_another_triton_kernels_already_imported_is_refused(peers, tmp_path, clean_imports):
    first, second = tmp_path / "a", tmp_path / "b"
    write_package(first, peers)
    write_package(second, peers)
    peers.load_triton_kernels(str(first))
    with pytest.raises(peers.TritonKernelsError, match="not from --triton-kernels"):
        peers.load_triton_kernels(str(second))


def test_unavailable_package_is_recorded_in_every_gpt_oss_row(peers, tmp_path):
    write_package(tmp_path, peers)
    a = peers.parse_args(["--models", "gpt-oss-20b,tiny", "--tokens", "1,8", "--mode", "w4a16", "--triton-kernels",
                          str(tmp_path)])
    doc = {"triton_kernels": peers.triton_kernels_doc(a)}
    rows = {(m, T): {"model": m, "tokens": T} for m in a.model_list for T in a.token_list}
    failures = []
    peers.triton_unavailable(a, doc, rows, failures, "missing triton_kernels.topk.topk")
    assert failures == ["triton_mxfp4: missing triton_kernels.topk.topk"]
    assert rows[("gpt-oss-20b", 8)]["triton_mxfp4_error"] == "missing triton_kernels.topk.topk"
    assert "triton_mxfp4_error" not in rows[("tiny", 1)]
    assert peers.triton_table_note(doc["triton_kernels"]) == "not run: missing triton_kernels.topk.topk"


def table_of(peers, tmp_path, argv):
    out = tmp_path / "peers.json"
    table = tmp_path / "peers.txt"
    rc = peers.main(["--no-fp4moe", "--models", "gpt-oss-20b", "--tokens", "1", "--json", str(out),
                     "--table", str(table), *argv])
    return rc, json.loads(out.read_text()), table.read_text()


def test_the_table_says_why_the_row_is_absent(peers, tmp_path):
    rc, doc, table = table_of(peers, tmp_path, [])
    assert "triton_mx4" in table.splitlines()[table.splitlines().index("") + 1]  # the header's column
    assert "triton_mx4: not run: no --triton-kernels PATH" in table
    assert doc["triton_kernels"]["requested"] is False
    row = doc["rows"][0]
    assert "triton_mxfp4_us" not in row
    if doc.get("torch_error"):  # this machine has no torch with CUDA: the run fails and says so
        assert rc == 1


def test_the_table_names_the_torch_error_when_torch_is_missing(peers, tmp_path, clean_imports):
    try:
        import torch  # noqa: F401

        if torch.cuda.is_available():
            pytest.skip("torch with CUDA is here: the row would run")
    except ImportError:
        pass
    write_package(tmp_path / "tk", peers)
    rc, doc, table = table_of(peers, tmp_path, ["--triton-kernels", str(tmp_path / "tk")])
    assert rc == 1
    assert doc["torch_error"]
    assert doc["rows"][0]["triton_mxfp4_error"] == doc["torch_error"]
    assert f"triton_mx4: not run: {doc['torch_error']}" in table

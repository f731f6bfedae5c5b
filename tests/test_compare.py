"""compare's plan: what identifies a row, and config errors caught before any work."""
import pytest

from runner.compare import plan
from runner.errors import UserError
from tests.conftest import compose


def test_row_keys_follow_what_determines_the_numbers(tmp_path):
    _, _, _, a = plan(compose("compare", ["multiplier=mul8s_1L2J", "backend=python"], tmp_path))
    _, _, _, b = plan(compose("compare", ["multiplier=mul8s_1KV6", "backend=python"], tmp_path))
    _, _, _, u = plan(compose("compare", ["multiplier=mul8u_17C8", "backend=python"], tmp_path))
    _, _, _, q = plan(compose("compare", ["multiplier=mul8s_1L2J", "backend=python",
                                          "quant=per_tensor_minmax"], tmp_path))
    assert a["pytorch"] == b["pytorch"] == u["pytorch"] == q["pytorch"]  # fp32 row shared by all
    assert a["fakequant"] == b["fakequant"] != u["fakequant"]            # depends on signedness only
    assert q["fakequant"] != a["fakequant"]                              # and on the quant scheme
    assert len({a["approx"], b["approx"], u["approx"], q["approx"]}) == 4


def test_unknown_layer_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="conv9"):
        plan(compose("compare", ["backend=python", "model.approx_layers=[conv9]"], tmp_path))


def test_selected_layers(tmp_path):
    _, layers, mults, _ = plan(compose("compare", ["backend=python", "model.approx_layers=[conv2,fc1]"], tmp_path))
    assert layers == ["conv2", "fc1"] and set(mults) == {"conv1", "conv2", "fc1", "fc2", "fc3"}

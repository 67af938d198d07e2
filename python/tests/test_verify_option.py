"""The layers' ``verify`` option: on by default, ``verify=False`` reaches the C ABI's settings
(``"verify": false``) through the layer's configuration, and anything but a bool is refused."""

import pytest
import torch

import mucudnn.torch as mt
from mucudnn.torch import _layer


def test_verify_is_a_layer_option_that_reaches_the_settings():
    assert _layer.LAYER_OPTIONS["verify"] is True
    assert _layer.make_settings().verify is True
    assert _layer.make_settings(verify=False).to_dict()["verify"] is False
    on = _layer.layer_config_text("conv", {})
    off = _layer.layer_config_text("conv", {"verify": False})
    assert '"verify":true' in on and '"verify":false' in off
    with pytest.raises(TypeError, match="conv: verify must be True or False"):
        _layer.layer_config_text("conv", {"verify": "yes"})


def test_an_unverified_layer_still_computes_the_convolution():
    torch.manual_seed(0)
    conv = mt.Conv2d(3, 4, 3, padding=1, verify=False, cache=False, policy="undivided",
                     split="batch", fallback=False)
    reference = torch.nn.Conv2d(3, 4, 3, padding=1)
    reference.load_state_dict(conv.state_dict())
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(conv(x), reference(x), rtol=1e-4, atol=1e-5)

"""Triton GPU kernels, each beside a plain-torch reference of the same function (installed as `atskv.kernels`)."""

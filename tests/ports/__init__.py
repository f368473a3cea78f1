"""Ports of JAX's and PyTorch's own remat, checkpoint and loop tests (lax_control_flow_test,
custom_api_test, memories_test, api_test, test_autograd), adapted to funckpt; see each file's docstring."""

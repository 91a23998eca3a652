"""What a SkyFed model is for (``classify`` or ``detect``) and the tag its ONNX files carry.

Torch-free on purpose: the on-device inference (``agent.infer``) imports it without PyTorch.
"""

TASKS = ("classify", "detect")
ONNX_FORMAT = "skyfed-onnx/1"  # metadata "format" of every ONNX file models.onnx_export writes

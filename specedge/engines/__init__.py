"""TensorRT engines for a bundle: optimization profiles, the plan.json contract and the builder.

`specedge build-engines BUNDLE` runs `builder.build_engines` on the device itself. Nothing here
imports tensorrt at import time: `profiles` and `plan_json` are pure and work on any machine.
"""

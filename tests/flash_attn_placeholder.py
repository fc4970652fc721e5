"""The adapter's ``flash_attn`` placeholder (``rlhfless_openrlhf.flash_attn_placeholder``) under the module name the
CPU launch puts on Ray workers' path (``worker_process_setup_hook: flash_attn_placeholder.install``)."""

from rlhfless_openrlhf.flash_attn_placeholder import install

__all__ = ["install"]

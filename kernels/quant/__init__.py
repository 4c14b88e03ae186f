"""fp8 quantization: OCP MX blocks with e8m0 scales, `ascend_dsa::dynamic_mx_quant` / `dequant_mx` (`mx`), and
DeepSeek-V3's per-tile fp32 scales, `ascend_dsa::dynamic_block_quant` / `dequant_block` (`block`).
"""

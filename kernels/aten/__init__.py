"""Native kernels the CPU runtime binds in place of ATen calls where they are faster, ATen for everything else:
decode-sized products for aten.mm (`skinny_mm`; bf16 ones in `skinny_bf16`) and aten.bmm (`skinny_bmm`), dense
attention with small head dims for torch's CPU flash attention (`dense_attention`) and depthwise 1-D convolutions
for aten.convolution (`depthwise_conv1d`).
"""

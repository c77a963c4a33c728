"""What goes where, as pure data: topology arithmetic, the cuts of a tensor, plan records
and checks, the family plug-ins (`archs/`) and quantization schemes (`quant/`). Nothing
here opens a weight file."""

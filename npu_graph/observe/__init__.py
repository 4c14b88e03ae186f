"""What a person sees of a compile: stage dumps (dump), the graph report behind summary.json (report) and the
implementation each fused op got (implementations), PyTorch's structured trace and log artifacts (trace),
verify=True's side-by-side check (verify), and progress lines on stderr (progress)."""

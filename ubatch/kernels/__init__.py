"""The op backends behind one abstract interface (`ops.Ops`): the torch reference, the fast CPU
backend, the CUDA backend; `backends` makes one by name."""

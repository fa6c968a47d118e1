"""CPU ranks forked from a process that has already imported torch and the tree's Megatron.

Why: on this 2-core CPU a verify run's start-up, not its iterations, is most of its time. Measured
on upstream main (d98e8a64dd, ported), Llama TP2 through torchrun: 1 iteration 8.0 s, 31 iterations
9.7 s (idle machine); each rank spends about 4.3 s importing torch and Megatron (``import torch``
1.6 s of it), and a default verify starts a few hundred ranks. Here the imports happen once per
(tree, entry point, environment): :mod:`.server` imports what the entry point imports, then forks
one child per rank torchrun starts; the rank's own process (:mod:`.client`, what
``megaport.train.launch`` runs when ``$MEGAPORT_PRELOADED_RANKS`` names a server) hands it its
stdin/stdout/stderr, environment and arguments, forwards signals, and exits with the child's code.
torchrun, the rendezvous and the script are unchanged; a child runs the script as a fresh rank would
(after the same CPU substitutions, in the same order).

Only CPU runs (``--cpu``): a GPU process must not fork after CUDA's driver is up. Whatever the server
cannot vouch for (another environment, a tree file changed since its imports, imports that failed or
started threads) it refuses, and the rank starts fresh as before: one line in its log says which.
``MEGAPORT_PRELOADED_RANKS=0`` in the verifying process turns it off (:mod:`.servers`).
"""

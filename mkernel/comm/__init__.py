"""Layer 2 (on runtime): the communicator and what it owns: MPI bootstrap and topology, collectives with
a timeout, the symmetric workspace (cuMem shared as file descriptors), the plan registry, the proxy
service that drains the GPU's command queue into a transport."""

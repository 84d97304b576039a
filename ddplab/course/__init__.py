"""Course tooling around the labs: exercise notebooks generated from the solutions, handouts
(every lab executed once as static HTML), and a lab's world size on this machine."""

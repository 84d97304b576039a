"""The repository as a whole: the layers and rooms of the package, the environments and make
targets, the facts the labs state, the GPU check's plan (tools/).
"""

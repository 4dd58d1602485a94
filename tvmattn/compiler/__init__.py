"""Compiling a model library: the Relax pipeline and its CPU schedule rules."""

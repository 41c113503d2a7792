"""Recipes: the library wired into whole jobs (torchtune's word).

    demo.py   `captioner demo`: the shapes set -> train -> evaluate -> an attention picture
"""

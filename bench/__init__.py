"""The lab: what this code measures, each answer a command (bench/README.md maps the rooms and has the results).
"""

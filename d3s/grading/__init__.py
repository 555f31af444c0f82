"""Answer grading with math-verify, shared by the training reward (d3s/rewards.py) and the evaluation, so a
model is rewarded as it is scored. ``policies`` says which answer of a completion is graded (the answer
policies and the bounded reading of boxes, tags and anchors), ``reading`` is math-verify's own reading of a
whole completion under a work budget, ``pool`` grades in worker processes under a time limit (Grader), and
``copied`` flags answers copied unevaluated from the prompt. The rules: docs/evaluation/grading.md."""

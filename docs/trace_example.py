"""Draws docs/trace.png, the README's picture of a small model's trace
(needs graphviz's ``dot``): python docs/trace_example.py"""

import subprocess

import tensorflow as tf

import fasttape

model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"),
                             tf.keras.layers.Dense(1)])
x, y = tf.random.normal((4, 3)), tf.random.normal((4, 1))
model(x)   # build the layers

with fasttape.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(model(x) - y))

print(tape.summary())
first_kernel = model.trainable_variables[0]
dot = tape.to_dot(targets=loss, sources=[first_kernel])
subprocess.run(["dot", "-Tpng", "-Gdpi=80", "-o", "docs/trace.png"],
               input=dot.encode(), check=True)
